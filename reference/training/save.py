r"""Saving a fine-tuned model as a GGUF that llama.cpp loads: ``llama_model_save_to_file``.

``finetune`` ends with ``llama_model_save_to_file(model, out_file)``
(``src/llama-model-saver.cpp``): the model's metadata (hyperparameters and tokenizer) and
every tensor **in its own type**: the trained ones are F32 (only F32 tensors are trainable),
the untouched quantized ones stay quantized. The specification trains a model dequantized to
float32 ([`reference.training.finetune`][reference.training.finetune]), so every tensor is
written F32 and ``general.file_type`` says so (``LLAMA_FTYPE_ALL_F32 = 0``).

The metadata is the source GGUF's, key for key and **type for type**: llama.cpp's loader
checks the stored type of each key it reads (``GGUFMeta::GKV::validate_type``), so a
``uint32`` written back as ``int32`` would be refused. Without a source file (a HF folder, a
random test model) the metadata is
[`reference.arch.llama_metadata`][reference.arch.llama_metadata]'s, with the dummy SPM
vocabulary unless one is given.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gguf import GGUFValueType

from reference.arch import llama_metadata
from reference.gguf import GGUF_DEFAULT_ALIGNMENT, GGUFValue, read_gguf, write_gguf
from reference.hparams import LlamaHParams
from reference.training.errors import TrainingError

LLAMA_FTYPE_ALL_F32 = 0  # llama_ftype: every tensor F32


# --8<-- [start:source_metadata]
def source_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """A GGUF's metadata with every scalar wrapped in its stored type
    ([`GGUFValue`][reference.gguf.GGUFValue]).

    Arrays keep their item type through their NumPy dtype (numbers) or as ``list[str]``
    (strings), which is how [`reference.gguf.write_gguf`][reference.gguf.write_gguf] types them.

    Examples:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "t.gguf"
        >>> write_gguf(p, {"n": GGUFValue(3, GGUFValueType.UINT8)}, {})
        >>> source_metadata(p)["n"].type.name
        'UINT8'
    """
    f = read_gguf(str(path))
    out = {}
    for key, value in f.metadata.items():
        vtype = f.value_types.get(key, GGUFValueType.ARRAY)
        out[key] = value if vtype == GGUFValueType.ARRAY else GGUFValue(value, vtype)
    return out
# --8<-- [end:source_metadata]


def _f32(name: str, t) -> np.ndarray:
    """A tensor as a float32 array (quantized ones dequantized, the values the forward uses)."""
    if hasattr(t, "dequantize"):
        return np.ascontiguousarray(t.dequantize(), dtype=np.float32)
    t = np.asarray(t)
    if not np.issubdtype(t.dtype, np.floating):
        raise TrainingError(f"tensor {name!r} has dtype {t.dtype}, not a float tensor")
    return np.ascontiguousarray(t, dtype=np.float32)


# --8<-- [start:model_save_to_file]
def model_save_to_file(
    path: str | os.PathLike,
    weights: dict,
    hparams: LlamaHParams,
    metadata: dict[str, Any] | None = None,
) -> None:
    """``llama_model_save_to_file``: the weights as an all-F32 GGUF with the model's metadata.

    Args:
        path: the output file (replaced if it exists; written whole or not at all).
        weights: GGUF-named weights: float arrays or quantized tensors (dequantized). A tied
            model has no ``output.weight``: none is written, so llama.cpp ties it again.
        hparams: the model's hyperparameters (``llama`` or ``qwen2``), for the metadata when
            ``metadata`` is None.
        metadata: the source GGUF's metadata ([`source_metadata`][]); None for
            [`reference.arch.llama_metadata`][reference.arch.llama_metadata].

    Raises:
        TrainingError: a tensor that is not a float tensor.
        reference.gguf.GGUFError: metadata or tensors the writer cannot encode.

    Examples:
        >>> import tempfile, pathlib
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.model_loader import load_model
        >>> hp = tiny_hparams(n_layer=1)
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "out.gguf"
        >>> model_save_to_file(p, random_weights(hp), hp)
        >>> hp2, w2 = load_model(p)
        >>> hp2.n_layer, w2["blk.0.attn_q.weight"].dtype
        (1, dtype('float32'))
    """
    tensors = {name: _f32(name, t) for name, t in weights.items()}
    metadata = dict(llama_metadata(hparams) if metadata is None else metadata)
    metadata["general.file_type"] = GGUFValue(LLAMA_FTYPE_ALL_F32, GGUFValueType.UINT32)
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    alignment = alignment.value if isinstance(alignment, GGUFValue) else alignment
    write_gguf(path, metadata, tensors, alignment=int(alignment))
# --8<-- [end:model_save_to_file]
