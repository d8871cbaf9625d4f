"""The model graphs: one module per architecture family, plus the simplest memory.

- :mod:`reference.models.llama`: ``llama`` (and Mistral) and ``qwen2``.
- :mod:`reference.models.simple_cache`: a single-sequence KV cache implementing the attention
  input the graphs read (:class:`reference.models.llama.AttnInput`).
"""
