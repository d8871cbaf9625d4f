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

from collections.abc import Callable
from pathlib import Path

import numpy as np

from reference.hparams import LlamaHParams, MambaHParams


class ModelLoadError(ValueError):
    """The path is neither a readable GGUF file nor a HF checkpoint folder."""


# --8<-- [start:load_model]
def load_model(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> tuple[LlamaHParams | MambaHParams, dict]:
    """Load ``path``: a ``.gguf`` file (:func:`reference.gguf.read_gguf`) or a HF folder
    (:func:`reference.hf.load_hf`).

    Args:
        path: a GGUF file, or a folder with ``config.json`` and ``*.safetensors``.
        progress: called with ``(bytes done, bytes in all)`` while the weights are read. A
            GGUF's tensors are then read into memory one by one (:func:`materialize`)
            instead of staying views of the file; a HF folder is read whole, and reports
            once at the end.

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

        hparams, weights = load_hf(path)
        if progress is not None:
            total = sum(_nbytes(t) for t in weights.values())
            progress(total, total)
        return hparams, weights
    if path.is_file():
        from reference.gguf import read_gguf

        gguf = read_gguf(str(path))
        tensors = gguf.tensors if progress is None else materialize(gguf.tensors, progress)
        return gguf.hparams, tensors
    raise ModelLoadError(f"{path}: no such file or folder")
# --8<-- [end:load_model]


# --8<-- [start:materialize]
def materialize(tensors: dict, progress: Callable[[int, int], None]) -> dict:
    """Copy every tensor out of the file's memory map, reporting the bytes read so far.

    Args:
        tensors: GGUF tensors (float arrays or :class:`~reference.quants.QuantizedTensor`
            views of the file).
        progress: called with ``(bytes done, bytes in all)`` after each tensor.

    Returns:
        The same tensors, in memory.

    Examples:
        >>> seen = []
        >>> out = materialize({"a": np.ones(4, np.float32)}, lambda d, t: seen.append((d, t)))
        >>> seen, out["a"].tolist()
        ([(16, 16)], [1.0, 1.0, 1.0, 1.0])
    """
    from reference.quants import QuantizedTensor

    total = sum(_nbytes(t) for t in tensors.values())
    done = 0
    out = {}
    for name, t in tensors.items():
        if isinstance(t, QuantizedTensor):
            out[name] = QuantizedTensor(t.qtype, t.shape, np.array(t.data))
        else:
            out[name] = np.array(t)
        done += _nbytes(t)
        progress(done, total)
    return out
# --8<-- [end:materialize]


def _nbytes(t) -> int:
    return int(t.data.nbytes) if hasattr(t, "qtype") else int(np.asarray(t).nbytes)
