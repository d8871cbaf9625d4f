"""Twin of :mod:`reference.models`: the model forwards on MLX (Llama/Qwen2 so far)."""

from accelerated.models.llama import llama_forward, prepare_weights

__all__ = ["llama_forward", "prepare_weights"]
