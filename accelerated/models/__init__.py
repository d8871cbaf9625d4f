"""Twin of [`reference.models`][reference.models]: the model forwards on MLX (Llama/Qwen2,
Gemma/Gemma 2/Gemma 3, Mamba/Mamba-2)."""

from accelerated.models.gemma import gemma_forward
from accelerated.models.llama import llama_forward, prepare_weights
from accelerated.models.mamba import mamba_forward

__all__ = ["gemma_forward", "llama_forward", "mamba_forward", "prepare_weights"]
