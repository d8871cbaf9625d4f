"""Load a model from a GGUF file or a HF checkpoint folder: ``(hparams, weights)``.

Either way the result is the same pair: the hyperparameters
(:class:`reference.hparams.LlamaHParams`, or :class:`reference.hparams.MambaHParams` for the
``mamba``/``mamba2`` architectures) and a dict of weights keyed by GGUF tensor names
(``"blk.0.attn_q.weight"``), matrices in NumPy order.
GGUF weights stay quantized (:class:`reference.quants.QuantizedTensor`) until the forward
dequantizes them; HF weights are float32 arrays with llama's Q/K rows already permuted
(:mod:`reference.hf`).
"""

from __future__ import annotations

from pathlib import Path

from reference.hparams import LlamaHParams, MambaHParams


class ModelLoadError(ValueError):
    """The path is neither a readable GGUF file nor a HF checkpoint folder."""


# --8<-- [start:load_model]
def load_model(path: str | Path) -> tuple[LlamaHParams | MambaHParams, dict]:
    """Load ``path``: a ``.gguf`` file (:func:`reference.gguf.read_gguf`) or a HF folder
    (:func:`reference.hf.load_hf`).

    Args:
        path: a GGUF file, or a folder with ``config.json`` and ``*.safetensors``.

    Returns:
        ``(hparams, weights)``.

    Raises:
        ModelLoadError: if ``path`` does not exist or is neither kind.
        reference.gguf.GGUFError: a malformed GGUF file.
        reference.hf.HFLoadError: an unsupported HF checkpoint.

    Examples:
        >>> load_model("/nonexistent.gguf")
        Traceback (most recent call last):
        ...
        reference.model.ModelLoadError: /nonexistent.gguf: no such file or folder
    """
    path = Path(path)
    if path.is_dir():
        from reference.hf import load_hf

        return load_hf(path)
    if path.is_file():
        from reference.gguf import read_gguf

        gguf = read_gguf(str(path))
        return gguf.hparams, gguf.tensors
    raise ModelLoadError(f"{path}: no such file or folder")
# --8<-- [end:load_model]
