"""The model graphs: one module per architecture family, plus the simplest memory.

- [`reference.models.llama`][reference.models.llama]: ``llama`` (and Mistral) and ``qwen2``.
- [`reference.models.gemma`][reference.models.gemma]: ``gemma``, ``gemma2`` and ``gemma3``
  (text): scaled embeddings, GeGLU, post-norms, Q/K norms, soft-caps, per-layer SWA and RoPE.
- [`reference.models.simple_cache`][reference.models.simple_cache]: a single-sequence KV cache
  implementing the attention input the graphs read
  ([`reference.models.llama.AttnInput`][reference.models.llama.AttnInput]).
"""
