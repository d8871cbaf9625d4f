"""The model graphs: one module per architecture family, plus the simplest memory.

- [`reference.models.llama`][reference.models.llama]: ``llama`` (and Mistral) and ``qwen2``.
- [`reference.models.simple_cache`][reference.models.simple_cache]: a single-sequence KV cache
  implementing the attention input the graphs read
  ([`reference.models.llama.AttnInput`][reference.models.llama.AttnInput]).
"""
