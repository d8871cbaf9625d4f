"""Twin of [`reference.models`][reference.models]: the model forwards on MLX (Llama/Qwen2,
Mamba/Mamba-2)."""

from accelerated.models.llama import llama_forward, prepare_weights
from accelerated.models.mamba import mamba_forward

__all__ = ["llama_forward", "mamba_forward", "prepare_weights"]
