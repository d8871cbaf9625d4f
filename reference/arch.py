r"""GGUF metadata keys per architecture: read into hyperparameters, and written back.

Mirrors llama.cpp's ``src/llama-arch.cpp`` (the key names, ``LLM_KV_*``, per architecture) and
``llama_model::load_hparams`` in ``src/llama-model.cpp`` (how each key is read: its type, its
default, its checks). The fields land in the dataclasses of
[`reference.hparams`][reference.hparams]; [`reference.gguf`][reference.gguf] is the container
only: it knows the bytes of a file, not what a key means to a model.

[`hparams_from_gguf`][] reads exactly the keys llama.cpp reads for the ``llama``, ``qwen2``,
``qwen3``, ``qwen3moe``, ``gemma``, ``gemma2`` and ``gemma3`` architectures
(``llama_model_base::load_hparams`` in ``src/llama-model.cpp``, then ``load_arch_hparams`` in
``src/models/llama.cpp`` / ``qwen2.cpp`` / ``qwen3.cpp`` / ``qwen3moe.cpp`` / ``gemma.cpp`` /
``gemma2.cpp`` / ``gemma3.cpp``; key names from
``src/llama-arch.cpp``). ``{arch}`` is ``general.architecture``:

| GGUF key | field | when absent |
|---|---|---|
| ``{arch}.context_length`` | ``n_ctx_train`` | required |
| ``{arch}.embedding_length`` | ``n_embd`` | required |
| ``{arch}.block_count`` | ``n_layer`` | required |
| ``{arch}.feed_forward_length`` | ``n_ff`` | required (1) |
| ``{arch}.attention.head_count`` | ``n_head`` | required (1) |
| ``{arch}.attention.head_count_kv`` | ``n_head_kv`` | ``n_head`` |
| ``{arch}.attention.key_length`` | ``n_embd_head_k`` | ``n_embd / n_head`` |
| ``{arch}.attention.value_length`` | ``n_embd_head_v`` | ``n_embd / n_head`` |
| ``{arch}.rope.dimension_count`` | ``n_rot`` | ``n_embd_head_k`` (llama: must equal it) |
| ``{arch}.attention.layer_norm_rms_epsilon`` | ``f_norm_rms_eps`` | required |
| ``{arch}.rope.freq_base`` | ``rope_freq_base_train`` | 10000 |
| ``{arch}.rope.scaling.type`` | ``rope_scaling_type_train`` | ``"linear"`` |
| ``{arch}.rope.scaling.factor`` | ``rope_freq_scale_train = 1/factor`` | 1 |
| ``{arch}.rope.scale_linear`` (its old name) | the same | read when the new one is absent |
| ``{arch}.rope.scaling.original_context_length`` | ``n_ctx_orig_yarn`` | ``n_ctx_train`` |
| ``{arch}.attention.sliding_window`` | ``n_swa``, ``swa_type`` (2) | 0, none; gemma2 (4) |
| ``gemma2.attention.sliding_window_pattern`` | ``swa_layers`` (3) | ``n_pattern = 2`` |
| ``gemma3.attention.sliding_window_pattern`` | ``swa_layers`` (3) | ``n_pattern = 6`` |
| ``gemma2.rope.freq_base_swa`` | ``rope_freq_base_train_swa`` | ``rope.freq_base`` |
| ``gemma3.rope.freq_base_swa`` | ``rope_freq_base_train_swa`` (3) | 10000 |
| ``gemma2.attn_logit_softcapping`` | ``f_attn_logit_softcapping`` | 50 (must be > 0) |
| ``gemma2.final_logit_softcapping`` | ``f_final_logit_softcapping`` | 30 (must be > 0) |
| ``gemma3.final_logit_softcapping`` | ``f_final_logit_softcapping`` | 0, none |
| ``llama.expert_count``, ``qwen3moe.expert_count`` | ``n_expert`` | 0 (dense) (8) |
| ``llama.expert_used_count``, ``qwen3moe.expert_used_count`` | ``n_expert_used`` | 0 |
| ``qwen3moe.expert_feed_forward_length`` | ``n_ff_exp`` | 0: ``n_ff / n_expert_used`` |
| ``tokenizer.ggml.tokens`` (length), else ``{arch}.vocab_size`` | ``n_vocab`` | required |
| (arch) | ``rope_type``: llama NORM, the others NEOX | |
| no ``output.weight`` tensor | ``tied_output`` (gemma, gemma2: always (5)) | |
| (arch, ``n_layer``) | ``f_attention_scale`` of gemma2, gemma3 (6) | |
| (arch) | ``rope_freq_scale_train_swa``: gemma2 (7), gemma3 1 | |

(1) Optional in llama.cpp's loader, but a Llama block cannot be built without it (tensor
creation fails there); here the missing key is named at once. (2) llama.cpp's ``llama`` and
``qwen2`` loaders do not read ``attention.sliding_window``: a file with that key runs with full
attention in llama.cpp. We read it, so that Mistral-style sliding-window models can be
described; oracle tests against llama.cpp must not set it. The same holds for ``gemma``.
(3) Gemma 2 always has a window, Gemma 3 only when ``attention.sliding_window`` is > 0 (it
reads its pattern and SWA base only then). The pattern key holds either the uint32
``n_pattern`` of [`swa_pattern`][] or, winning over it, an array of per-layer flags (bool,
int32 or uint32; at most 512 items; layers past its end are dense, as llama.cpp copies it
over all-dense flags; ``llama_model_base::load_swa_pattern``). (4) 4096, and it must be > 0.
(5) A gemma/gemma2 file with an ``output.weight`` is refused: llama.cpp's loader creates no
output tensor for them. (6) Gemma's query scale has no key: llama.cpp derives it from the layer
count ([`gemma_attention_scale`][]). (7) Gemma 2's ``rope_freq_scale_train``; Gemma 3's RoPE
scaling is for its global layers only. (8) A ``llama`` file with experts is Mixtral; a
``qwen3moe`` file must have them; both graphs normalise the chosen experts' weights, so
``expert_weights_norm`` is always True. [`llama_metadata`][] refuses hyperparameters a file
cannot state ([`gguf_representable_errors`][]).

The selective state space models (``mamba``, ``mamba2``) are read by
[`mamba_hparams_from_gguf`][] from the ``{arch}.ssm.*`` keys into
[`MambaHParams`][reference.hparams.MambaHParams].

Like llama.cpp, floats are held as float32 and a key may hold one value per layer (an
array of ``n_layer`` items); the dataclasses hold one value, so per-layer arrays must be
uniform.

The keys are one table in code, `GGUF_KEYS` (a [`GGUFKey`][] per row: key, field,
type, default, per-layer or not, conversion), read in both directions:
[`hparams_from_gguf`][] reads a file's metadata through it, and [`llama_metadata`][] /
[`mamba_metadata`][] write hyperparameters as metadata through it, so that the reader and
the writer cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference.gguf import GGUFError, GGUFFile
from reference.hparams import (
    GEMMA_ARCHS,
    LLAMA_ARCHS,
    MAMBA_ARCHS,
    ROPE_SCALING_TYPE_NAMES,
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    HParamsError,
    LlamaHParams,
    MambaHParams,
    gemma_attention_scale,
    swa_pattern,
)

# ---------------------------------------------------------------------------------------------
# GGUF metadata: one table of keys, read by hparams_from_gguf, written by llama_metadata
# ---------------------------------------------------------------------------------------------

#: A `GGUFKey` default: the key must be present.
REQUIRED = object()
_U32_MAX = 2**32 - 1


# --8<-- [start:GGUFKey]
@dataclass(frozen=True)
class GGUFKey:
    """One row of `GGUF_KEYS`: the metadata key ``{arch}.{key}`` and the field it holds.

    [`hparams_from_gguf`][] reads the rows in order, so a default or a check may use the
    fields read before it; [`llama_metadata`][] and [`mamba_metadata`][] write the same
    rows back, so that reading what was written gives the hyperparameters again.

    Attributes:
        key: the key without its ``{arch}.`` prefix (``"attention.head_count"``).
        field: the field of [`LlamaHParams`][] / [`MambaHParams`][] (``"n_head"``).
        kind: the type of the stored value: ``int`` (a uint32), ``float`` (held as a
            float32, like llama.cpp), ``str`` or ``bool``; ``np.asarray`` for a value that
            is not checked on reading (its ``decode`` checks it) and written as an array.
        default: what an absent key reads as: `REQUIRED`, a stored value, or a
            function of the fields read so far (``lambda f: f["n_head"]``).
        per_layer: the key may hold one value per layer (llama.cpp's ``get_key_or_arr``);
            the values must be equal.
        old_key: an older name of the key, read when ``key`` is absent, never written.
        decode: the field from the stored value, when they differ; raises ``ValueError``
            for a value it does not know.
        encode: the stored value from the hyperparameters: the inverse of ``decode``.
        check: a rule on the fields read so far, applied once this key is read: an error
            message, or None.
        omit_default: the writer leaves the key out when the field holds what an absent
            key reads as (the converter writes these keys only when they are set).
        decode_layers: ``decode`` also takes ``n_layer`` (``decode(value, n_layer)``), for a
            value that becomes one entry per layer.
        when: the key is read (and written) only when this holds for the fields read so far
            (Gemma 3 reads its SWA keys only with a window); otherwise the field keeps its
            dataclass default.

    Examples:
        >>> row = GGUFKey("attention.head_count_kv", "n_head_kv", int, lambda f: f["n_head"])
        >>> fields = {"arch": "llama", "n_head": 4}  # read before this row
        >>> _read_key({"llama.attention.head_count_kv": 2}, row, fields)
        2
        >>> _read_key({}, row, fields)  # absent: the default
        4
    """

    key: str
    field: str
    kind: type
    default: Any = REQUIRED
    per_layer: bool = False
    old_key: str | None = None
    decode: Callable[[Any], Any] | None = None
    encode: Callable[[Any], Any] | None = None
    check: Callable[[dict[str, Any]], str | None] | None = None
    omit_default: bool = False
    decode_layers: bool = False
    when: Callable[[dict[str, Any]], bool] | None = None
# --8<-- [end:GGUFKey]


def _has_layers(f: dict[str, Any]) -> str | None:
    return None if f["n_layer"] > 0 else "must be > 0"


def _whole_kv_groups(f: dict[str, Any]) -> str | None:
    """Query heads come in whole groups per KV head (checked before ``n_embd / n_head``)."""
    n_head, n_head_kv = f["n_head"], f["n_head_kv"]
    if n_head > 0 and n_head_kv > 0 and n_head % n_head_kv == 0:
        return None
    return f"n_head={n_head} must be a positive multiple of n_head_kv={n_head_kv}"


def _llama_rotates_whole_heads(f: dict[str, Any]) -> str | None:
    """llama.cpp's ``llama`` loader requires ``n_rot == n_embd_head_k`` (qwen2 does not)."""
    if f["arch"] == "llama" and f["n_rot"] != f["n_embd_head_k"]:
        return f"invalid n_rot: {f['n_rot']}, expected {f['n_embd_head_k']} (llama)"
    return None


def _rope_scaling_type(name: str) -> int:
    """A ``rope.scaling.type`` name to its ``ROPE_SCALING_TYPE_*``."""
    types = {n: t for t, n in ROPE_SCALING_TYPE_NAMES.items()}
    if name not in types:
        raise ValueError(f"unsupported RoPE scaling {name!r}")
    return types[name]


def _freq_scale(factor: float) -> float:
    """``rope.scaling.factor`` to ``rope_freq_scale_train = 1 / factor`` (0: no factor)."""
    return 1.0 if factor == 0.0 else float(np.float32(1.0) / np.float32(factor))


# --8<-- [start:swa_layers_key]
#: ``LLAMA_MAX_LAYERS``: the longest per-layer array llama.cpp's loader accepts.
LLAMA_MAX_LAYERS = 512
#: Gemma 2's window when the file has none (``llama_model_gemma2::load_arch_hparams``).
GEMMA2_N_SWA = 4096


def _swa_layers(value: Any, n_layer: int) -> tuple[bool, ...]:
    """``attention.sliding_window_pattern``, as ``llama_model_base::load_swa_pattern`` reads it.

    An array (bool, int32 or uint32 items, at most ``LLAMA_MAX_LAYERS``) is the per-layer
    flags and wins; llama.cpp copies it over all-dense flags, so layers past its end are dense
    and items past ``n_layer`` are ignored. Otherwise the key is the uint32 ``n_pattern`` of
    [`swa_pattern`][].

    Examples:
        >>> _swa_layers(np.array([True, False, True]), 4), _swa_layers(3, 4)
        ((True, False, True, False), (True, True, False, True))
    """
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype not in (np.bool_, np.int32, np.uint32):
            raise ValueError(f"an array must hold bool, int32 or uint32 items, got {value.dtype}")
        if len(value) > LLAMA_MAX_LAYERS:
            raise ValueError(f"{len(value)} items exceed LLAMA_MAX_LAYERS = {LLAMA_MAX_LAYERS}")
        flags = tuple(bool(v) for v in value[:n_layer])
        return flags + (False,) * (n_layer - len(flags))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U32_MAX:
        raise ValueError(
            f"must be a uint32 n_pattern or an array of per-layer flags, got {value!r}")
    return swa_pattern(n_layer, value)


def _encode_swa_layers(hp: LlamaHParams) -> np.ndarray:
    """The per-layer flags as a bool array (what ``is_swa`` says for every layer)."""
    return np.array([hp.is_swa(il) for il in range(hp.n_layer)], dtype=bool)  # (n_layer,)


def _has_window(f: dict[str, Any]) -> str | None:
    """Gemma 2 always has SWA layers: a 0 window would hide every cell from them."""
    return None if f["n_swa"] > 0 else "must be > 0 (gemma2's SWA layers need a window)"


def _with_window(f: dict[str, Any]) -> bool:
    """Gemma 3 reads its SWA keys only when ``attention.sliding_window`` is > 0."""
    return f["n_swa"] > 0


def _freq_base_swa(hp: LlamaHParams) -> float:
    """The SWA layers' RoPE base to write: 0 means the global one."""
    return hp.rope_freq_base_train_swa or hp.rope_freq_base_train


def _positive_cap(field: str) -> Callable[[dict[str, Any]], str | None]:
    """llama.cpp divides by Gemma 2's caps (``1.0f / cap``): they must be > 0."""
    return lambda f: None if f[field] > 0 else "must be > 0 (llama.cpp divides by it)"
# --8<-- [end:swa_layers_key]


# --8<-- [start:GGUF_KEYS]

_LLAMA_KEYS = (  # in the order they are read: a default or a check uses the rows above it
    GGUFKey("block_count", "n_layer", int, check=_has_layers),
    GGUFKey("embedding_length", "n_embd", int),
    GGUFKey("attention.head_count", "n_head", int, per_layer=True),
    GGUFKey("attention.head_count_kv", "n_head_kv", int, lambda f: f["n_head"],
            per_layer=True, check=_whole_kv_groups),
    GGUFKey("attention.key_length", "n_embd_head_k", int, lambda f: f["n_embd"] // f["n_head"]),
    GGUFKey("attention.value_length", "n_embd_head_v", int,
            lambda f: f["n_embd"] // f["n_head"]),
    GGUFKey("rope.dimension_count", "n_rot", int, lambda f: f["n_embd_head_k"],
            check=_llama_rotates_whole_heads),
    GGUFKey("context_length", "n_ctx_train", int),
    GGUFKey("rope.scaling.type", "rope_scaling_type_train", str, "linear",
            decode=_rope_scaling_type,
            encode=lambda hp: ROPE_SCALING_TYPE_NAMES[hp.rope_scaling_type_train]),
    GGUFKey("rope.scaling.factor", "rope_freq_scale_train", float, 0.0,
            old_key="rope.scale_linear", decode=_freq_scale,
            encode=lambda hp: 1.0 / hp.rope_freq_scale_train, omit_default=True),
    GGUFKey("attention.sliding_window", "n_swa", int, 0, omit_default=True),
    GGUFKey("feed_forward_length", "n_ff", int, per_layer=True),
    GGUFKey("attention.layer_norm_rms_epsilon", "f_norm_rms_eps", float),
    GGUFKey("rope.freq_base", "rope_freq_base_train", float, 10000.0),
    GGUFKey("rope.scaling.original_context_length", "n_ctx_orig_yarn", int,
            lambda f: f["n_ctx_train"], encode=lambda hp: hp.n_ctx_orig_yarn or hp.n_ctx_train),
)

_EXPERT_KEYS = (  # llama_model_base::load_hparams reads them for every arch (0: no experts)
    GGUFKey("expert_count", "n_expert", int, 0, omit_default=True),
    GGUFKey("expert_used_count", "n_expert_used", int, 0, per_layer=True, omit_default=True),
)

_QWEN3MOE_KEYS = (  # llama_model_qwen3moe::load_arch_hparams: the experts' width
    *_LLAMA_KEYS,
    *_EXPERT_KEYS,
    GGUFKey("expert_feed_forward_length", "n_ff_exp", int, 0, per_layer=True,
            omit_default=True),
)

_GEMMA2_KEYS = (  # llm_build_gemma2's load_arch_hparams, after the common keys
    *(row for row in _LLAMA_KEYS if row.key != "attention.sliding_window"),
    GGUFKey("attention.sliding_window", "n_swa", int, GEMMA2_N_SWA, check=_has_window),
    GGUFKey("attention.sliding_window_pattern", "swa_layers", np.asarray, 2,
            decode=_swa_layers, decode_layers=True, encode=_encode_swa_layers),
    GGUFKey("rope.freq_base_swa", "rope_freq_base_train_swa", float,
            lambda f: f["rope_freq_base_train"], encode=_freq_base_swa),
    GGUFKey("attn_logit_softcapping", "f_attn_logit_softcapping", float, 50.0,
            check=_positive_cap("f_attn_logit_softcapping")),
    GGUFKey("final_logit_softcapping", "f_final_logit_softcapping", float, 30.0,
            check=_positive_cap("f_final_logit_softcapping")),
)

_GEMMA3_KEYS = (  # llm_build_gemma3's: the SWA keys only with a window
    *(row for row in _LLAMA_KEYS if row.key != "attention.sliding_window"),
    GGUFKey("attention.sliding_window", "n_swa", int, 0),
    GGUFKey("attention.sliding_window_pattern", "swa_layers", np.asarray, 6,
            decode=_swa_layers, decode_layers=True, encode=_encode_swa_layers,
            when=_with_window),
    GGUFKey("rope.freq_base_swa", "rope_freq_base_train_swa", float, 10000.0,
            encode=_freq_base_swa, when=_with_window),
    GGUFKey("final_logit_softcapping", "f_final_logit_softcapping", float, 0.0,
            omit_default=True),
)

_MAMBA_KEYS = (
    GGUFKey("block_count", "n_layer", int, check=_has_layers),
    GGUFKey("embedding_length", "n_embd", int),
    GGUFKey("context_length", "n_ctx_train", int),
    GGUFKey("ssm.conv_kernel", "ssm_d_conv", int),
    GGUFKey("ssm.inner_size", "ssm_d_inner", int),
    GGUFKey("ssm.state_size", "ssm_d_state", int),
    GGUFKey("ssm.time_step_rank", "ssm_dt_rank", int),
    GGUFKey("attention.layer_norm_rms_epsilon", "f_norm_rms_eps", float),
)

#: ``general.architecture`` -> the ``{arch}.*`` keys its loader reads, in the order it reads
#: them. The fields not in the table are derived: ``n_vocab`` from the vocabulary,
#: ``tied_output`` from the tensors, ``rope_type`` from the architecture, ``swa_type`` from
#: ``n_swa``; for Gemma 2/3 ``f_attention_scale`` and ``rope_freq_scale_train_swa``
#: (``_gemma_derived_fields``).
GGUF_KEYS: dict[str, tuple[GGUFKey, ...]] = {
    "llama": (*_LLAMA_KEYS, *_EXPERT_KEYS),  # Mixtral: llama with experts
    "qwen2": _LLAMA_KEYS,
    "qwen3": _LLAMA_KEYS,
    "qwen3moe": _QWEN3MOE_KEYS,
    "gemma": _LLAMA_KEYS,
    "gemma2": _GEMMA2_KEYS,
    "gemma3": _GEMMA3_KEYS,
    "mamba": (*_MAMBA_KEYS, GGUFKey("ssm.dt_b_c_rms", "ssm_dt_b_c_rms", bool, False)),
    "mamba2": (*_MAMBA_KEYS, GGUFKey("ssm.group_count", "ssm_n_group", int)),
}
# --8<-- [end:GGUF_KEYS]


# ---------------------------------------------------------------------------------------------
# Reading: metadata -> hyperparameters
# ---------------------------------------------------------------------------------------------


def _get(metadata: dict[str, Any], key: str, default: Any, kind: type, n_layer: int = 0) -> Any:
    """One value of ``metadata[key]`` of Python type ``kind`` (a uniform per-layer array ok)."""
    if key not in metadata:
        if default is REQUIRED:
            raise GGUFError(f"missing required key {key!r}")
        return default
    value = metadata[key]
    if n_layer and isinstance(value, np.ndarray) and value.ndim == 1:
        if len(value) != n_layer:
            raise GGUFError(f"key {key!r}: {len(value)} per-layer values, expected {n_layer}")
        if np.any(value != value[0]):
            raise GGUFError(f"key {key!r}: per-layer values differ, which is not supported")
        value = value[0].item()
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise GGUFError(f"key {key!r} must be an integer, got {value!r}")
    if kind is int and not 0 <= value <= _U32_MAX:
        raise GGUFError(f"key {key!r} must fit a uint32, got {value}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GGUFError(f"key {key!r} must be a number, got {value!r}")
        if abs(value) > np.finfo(np.float32).max and math.isfinite(value):
            raise GGUFError(f"key {key!r}: {value} does not fit a float32")
        return float(np.float32(value))  # llama_hparams holds float
    if kind is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise GGUFError(f"key {key!r} must be a bool, got {value!r}")
        return bool(value)
    if kind is str and not isinstance(value, str):
        raise GGUFError(f"key {key!r} must be a string, got {value!r}")
    return value


# --8<-- [start:read_gguf_keys]
def _read_key(metadata: dict[str, Any], row: GGUFKey, fields: dict[str, Any]) -> Any:
    """The value of one row's field: read (or defaulted), checked for its type, decoded."""
    arch = fields["arch"]
    key = f"{arch}.{row.key}"
    if row.old_key is not None and key not in metadata and f"{arch}.{row.old_key}" in metadata:
        key = f"{arch}.{row.old_key}"
    default = row.default(fields) if callable(row.default) else row.default
    value = _get(metadata, key, default, row.kind, fields["n_layer"] if row.per_layer else 0)
    if row.decode is None:
        return value
    try:
        return row.decode(value, fields["n_layer"]) if row.decode_layers else row.decode(value)
    except ValueError as e:
        raise GGUFError(f"key {key!r}: {e}") from None


def _read_gguf_keys(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """The fields of ``GGUF_KEYS[arch]``, read in the table's order, each row checked."""
    fields: dict[str, Any] = {"arch": arch}
    for row in GGUF_KEYS[arch]:
        if row.when is not None and not row.when(fields):
            continue
        fields[row.field] = _read_key(metadata, row, fields)
        error = row.check(fields) if row.check is not None else None
        if error is not None:
            raise GGUFError(f"key '{arch}.{row.key}': {error}")
    return fields
# --8<-- [end:read_gguf_keys]


def _n_vocab(metadata: dict[str, Any], arch: str) -> int:
    """The vocabulary size: the token list's length, else ``{arch}.vocab_size``."""
    if "tokenizer.ggml.tokens" in metadata:
        tokens = metadata["tokenizer.ggml.tokens"]
        if not isinstance(tokens, list):
            raise GGUFError("key 'tokenizer.ggml.tokens' must be an array of strings")
        return len(tokens)
    return _get(metadata, f"{arch}.vocab_size", REQUIRED, int)


def _tied_output(tensor_names: Iterable[str] | None) -> bool:
    """True when the file has tensors and no ``output.weight`` among them."""
    return tensor_names is not None and "output.weight" not in set(tensor_names)


def _checked(cls: type, fields: dict[str, Any]) -> LlamaHParams | MambaHParams:
    """``cls(**fields)``, its [`HParamsError`][] reported as the file's error."""
    try:
        return cls(**fields)
    except HParamsError as e:
        raise GGUFError(f"inconsistent hyperparameters: {e}") from e


# --8<-- [start:hparams_from_gguf]
def hparams_from_gguf(
    arch: str, metadata: dict[str, Any], tensor_names: Iterable[str] | None = None
) -> LlamaHParams | MambaHParams:
    """Hyperparameters from GGUF metadata, as ``llama_model::load_hparams`` reads them.

    The keys are the rows of `GGUF_KEYS` (the table in the module docstring);
    ``mamba`` and ``mamba2`` go to [`mamba_hparams_from_gguf`][].

    Args:
        arch: ``general.architecture``: ``"llama"``, ``"qwen2"``, ``"mamba"`` or ``"mamba2"``.
        metadata: the GGUF key/value pairs (``GGUFFile.metadata``).
        tensor_names: the file's tensor names; ``tied_output`` is True when they lack
            ``output.weight``. None leaves ``tied_output`` False.

    Returns:
        The [`LlamaHParams`][] ([`MambaHParams`][] for ``mamba``/``mamba2``).

    Raises:
        GGUFError: an unsupported architecture, a missing required key (named), a value of
            the wrong type, a head count that does not divide ``n_embd``, ``n_rot`` other than
            the head size for llama, an unknown RoPE scaling type, non-uniform per-layer values.

    Examples:
        >>> md = {"llama.context_length": 128, "llama.embedding_length": 64,
        ...       "llama.block_count": 2, "llama.feed_forward_length": 96,
        ...       "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        ...       "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 100}
        >>> hp = hparams_from_gguf("llama", md, tensor_names=["token_embd.weight"])
        >>> hp.n_embd_head_k, hp.n_rot, hp.n_gqa(), hp.rope_freq_base_train, hp.tied_output
        (16, 16, 2, 10000.0, True)
    """
    if arch in MAMBA_ARCHS:
        return mamba_hparams_from_gguf(arch, metadata, tensor_names)
    if arch not in LLAMA_ARCHS:
        raise GGUFError(
            f"unsupported architecture {arch!r}: expected one of {(*LLAMA_ARCHS, *MAMBA_ARCHS)}"
        )
    fields = _read_gguf_keys(metadata, arch)
    fields["n_vocab"] = _n_vocab(metadata, arch)
    fields["rope_type"] = ROPE_TYPE_NORM if arch == "llama" else ROPE_TYPE_NEOX
    fields["swa_type"] = SWA_TYPE_STANDARD if fields["n_swa"] else SWA_TYPE_NONE
    fields["tied_output"] = _tied_output(tensor_names)
    if arch in GEMMA_ARCHS:
        _gemma_derived_fields(fields, tensor_names)
    return _checked(LlamaHParams, fields)
# --8<-- [end:hparams_from_gguf]



def _gemma_derived_fields(fields: dict[str, Any], tensor_names: Iterable[str] | None) -> None:
    """The fields llama.cpp's Gemma loaders set without a key (``load_arch_hparams``)."""
    arch = fields["arch"]
    if arch in ("gemma", "gemma2"):
        # the output is token_embd (TENSOR_DUPLICATED): no output.weight is created
        if tensor_names is not None and "output.weight" in set(tensor_names):
            raise GGUFError(f"{arch}: the file has output.weight, but llama.cpp's {arch} "
                            "reuses token_embd as the output and loads no output tensor")
        fields["tied_output"] = True
    if arch == "gemma":
        return
    fields["f_attention_scale"] = gemma_attention_scale(
        arch, fields["n_layer"], fields["n_embd"], fields["n_head"], fields["n_embd_head_k"])
    if arch == "gemma2":  # rope_freq_scale_train_swa = rope_freq_scale_train
        fields["rope_freq_scale_train_swa"] = fields["rope_freq_scale_train"]
    elif fields["n_swa"] > 0:  # gemma3: the scaling is for the global layers only
        fields["rope_freq_scale_train_swa"] = 1.0


# --8<-- [start:mamba_hparams_from_gguf]
def mamba_hparams_from_gguf(
    arch: str, metadata: dict[str, Any], tensor_names: Iterable[str] | None = None
) -> MambaHParams:
    """Hyperparameters of a ``mamba``/``mamba2`` GGUF, as ``llama_model_mamba{,2}::
    load_arch_hparams`` reads them (``src/models/mamba.cpp``, ``mamba2.cpp``).

    | GGUF key | field | when absent |
    |---|---|---|
    | ``{arch}.context_length`` | ``n_ctx_train`` | required |
    | ``{arch}.embedding_length`` | ``n_embd`` | required |
    | ``{arch}.block_count`` | ``n_layer`` | required |
    | ``{arch}.ssm.conv_kernel`` | ``ssm_d_conv`` | required |
    | ``{arch}.ssm.inner_size`` | ``ssm_d_inner`` | required |
    | ``{arch}.ssm.state_size`` | ``ssm_d_state`` | required |
    | ``{arch}.ssm.time_step_rank`` | ``ssm_dt_rank`` | required |
    | ``mamba2.ssm.group_count`` | ``ssm_n_group`` | required (mamba2); not read (mamba) |
    | ``mamba.ssm.dt_b_c_rms`` | ``ssm_dt_b_c_rms`` | false; not read (mamba2) |
    | ``{arch}.attention.layer_norm_rms_epsilon`` | ``f_norm_rms_eps`` | required |
    | ``tokenizer.ggml.tokens`` (length), else ``{arch}.vocab_size`` | ``n_vocab`` | required |
    | no ``output.weight`` tensor | ``tied_output`` | |

    The converter also writes ``feed_forward_length = 0`` and ``attention.head_count = 0``,
    which a recurrent model does not use (they are not read here).

    Args:
        arch: ``"mamba"`` or ``"mamba2"``.
        metadata: the GGUF key/value pairs.
        tensor_names: the file's tensor names (for ``tied_output``); None leaves it False.

    Returns:
        The [`MambaHParams`][].

    Raises:
        GGUFError: another architecture, a missing required key (named), a value of the
            wrong type, sizes that cannot describe a model
            ([`mamba_hparams_errors`][reference.hparams.mamba_hparams_errors]).

    Examples:
        >>> md = {"mamba2.context_length": 1024, "mamba2.embedding_length": 16,
        ...       "mamba2.block_count": 2, "mamba2.ssm.conv_kernel": 4,
        ...       "mamba2.ssm.inner_size": 32, "mamba2.ssm.state_size": 8,
        ...       "mamba2.ssm.time_step_rank": 4, "mamba2.ssm.group_count": 2,
        ...       "mamba2.attention.layer_norm_rms_epsilon": 1e-5, "mamba2.vocab_size": 48}
        >>> hp = mamba_hparams_from_gguf("mamba2", md)
        >>> hp.n_head(), hp.head_dim(), hp.n_embd_r(), hp.n_embd_s()
        (4, 8, 192, 256)
        >>> mamba_hparams_from_gguf("mamba", md)
        Traceback (most recent call last):
        ...
        reference.gguf.GGUFError: missing required key 'mamba.block_count'
    """
    if arch not in MAMBA_ARCHS:
        raise GGUFError(f"unsupported architecture {arch!r}: expected one of {MAMBA_ARCHS}")
    fields = _read_gguf_keys(metadata, arch)
    fields["n_vocab"] = _n_vocab(metadata, arch)
    fields["tied_output"] = _tied_output(tensor_names)
    return _checked(MambaHParams, fields)
# --8<-- [end:mamba_hparams_from_gguf]


# --8<-- [start:hparams_from_file]
def hparams_from_file(f: GGUFFile) -> LlamaHParams | MambaHParams:
    """The hyperparameters of a file read by [`reference.gguf.read_gguf`][reference.gguf.read_gguf].

    [`hparams_from_gguf`][] on its architecture, metadata and tensor names:
    ``tied_output`` is True when the file has no ``output.weight``.

    Raises:
        GGUFError: as [`hparams_from_gguf`][], or ``general.architecture`` is missing.

    Examples:
        >>> import tempfile, pathlib
        >>> from reference.gguf import read_gguf, write_gguf
        >>> hp = MambaHParams("mamba", n_vocab=8, n_embd=4, n_layer=1, n_ctx_train=16,
        ...     ssm_d_conv=4, ssm_d_inner=8, ssm_d_state=2, ssm_dt_rank=1, f_norm_rms_eps=1e-5)
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "m.gguf"
        >>> write_gguf(p, mamba_metadata(hp), {"token_embd.weight": np.zeros((8, 4), np.float32)})
        >>> hparams_from_file(read_gguf(p)).tied_output
        True
    """
    return hparams_from_gguf(f.arch, f.metadata, tensor_names=f.tensors.keys())
# --8<-- [end:hparams_from_file]


# ---------------------------------------------------------------------------------------------
# Writing: hyperparameters -> metadata (the same table, the other way)
# ---------------------------------------------------------------------------------------------

# llama.cpp's llama_token_type, as tokenizer.ggml.token_type stores it.
LLAMA_TOKEN_TYPE_NORMAL = 1
LLAMA_TOKEN_TYPE_UNKNOWN = 2
LLAMA_TOKEN_TYPE_CONTROL = 3
LLAMA_TOKEN_TYPE_BYTE = 6

# Keys convert_hf_to_gguf writes for a recurrent model (MambaModel, Mamba2Model), unread.
_MAMBA_UNREAD_KEYS = {"feed_forward_length": 0, "attention.head_count": 0}


# --8<-- [start:spm_dummy_vocab]
def spm_dummy_vocab(n_vocab: int) -> dict[str, Any]:
    """A minimal SentencePiece-style (``"llama"``) vocabulary of ``n_vocab`` tokens.

    Token 0 is ``<unk>``, 1 ``<s>`` (BOS), 2 ``</s>`` (EOS), then the byte tokens
    ``<0x00>``..``<0xFF>`` as far as they fit, then ``tok{i}`` pieces with score ``-i``.
    It is enough for llama.cpp to load a random model.

    Args:
        n_vocab: number of tokens, at least 3.

    Returns:
        The ``tokenizer.ggml.*`` metadata keys.

    Raises:
        GGUFError: ``n_vocab < 3``.

    Examples:
        >>> tokens = spm_dummy_vocab(300)["tokenizer.ggml.tokens"]
        >>> tokens[:4], tokens[-1]
        (['<unk>', '<s>', '</s>', '<0x00>'], 'tok299')
    """
    if n_vocab < 3:
        raise GGUFError(f"a vocabulary needs at least 3 tokens (unk, bos, eos), got {n_vocab}")
    tokens = ["<unk>", "<s>", "</s>"]
    types = [LLAMA_TOKEN_TYPE_UNKNOWN, LLAMA_TOKEN_TYPE_CONTROL, LLAMA_TOKEN_TYPE_CONTROL]
    n_bytes = min(256, n_vocab - 3)
    tokens += [f"<0x{b:02X}>" for b in range(n_bytes)]
    types += [LLAMA_TOKEN_TYPE_BYTE] * n_bytes
    tokens += [f"tok{i}" for i in range(len(tokens), n_vocab)]
    types += [LLAMA_TOKEN_TYPE_NORMAL] * (n_vocab - len(types))
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": -np.arange(n_vocab, dtype=np.float32),  # (n_vocab,)
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),  # (n_vocab,)
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
# --8<-- [end:spm_dummy_vocab]


# --8<-- [start:write_gguf_keys]
def _absent_value(row: GGUFKey) -> Any:
    """What the field reads as when the key is absent (a row whose default is a constant)."""
    return row.decode(row.default) if row.decode is not None else row.default


def _write_gguf_keys(hparams: LlamaHParams | MambaHParams) -> dict[str, Any]:
    """The ``{arch}.*`` keys of ``GGUF_KEYS[hparams.arch]``: the inverse of the reading."""
    arch = hparams.arch
    md: dict[str, Any] = {}
    fields = dataclasses.asdict(hparams)
    for row in GGUF_KEYS[arch]:
        if row.when is not None and not row.when(fields):
            continue
        if row.omit_default and getattr(hparams, row.field) == _absent_value(row):
            continue
        value = row.encode(hparams) if row.encode is not None else getattr(hparams, row.field)
        md[f"{arch}.{row.key}"] = row.kind(value)
    return md
# --8<-- [end:write_gguf_keys]


def _model_metadata(
    hparams: LlamaHParams | MambaHParams, vocab: dict[str, Any] | None
) -> dict[str, Any]:
    """Name, table keys and vocabulary (checked against ``n_vocab``) of a model."""
    vocab = spm_dummy_vocab(hparams.n_vocab) if vocab is None else dict(vocab)
    if len(vocab.get("tokenizer.ggml.tokens", ())) != hparams.n_vocab:
        raise GGUFError(f"the vocabulary must have n_vocab={hparams.n_vocab} tokens")
    return {
        "general.architecture": hparams.arch,
        "general.name": f"llamaref {hparams.arch}",
        **_write_gguf_keys(hparams),
        **vocab,
    }


# --8<-- [start:llama_metadata]
def llama_metadata(hparams: LlamaHParams, vocab: dict[str, Any] | None = None) -> dict[str, Any]:
    """The GGUF metadata that describes ``hparams`` (an arch of ``LLAMA_ARCHS``).

    The inverse of [`hparams_from_gguf`][], through the same table (`GGUF_KEYS`):
    reading the keys back gives ``hparams`` again (floats rounded to float32, as llama.cpp
    stores them; ``n_ctx_orig_yarn = 0`` becomes ``n_ctx_train``; ``tied_output`` comes from
    the tensors).

    Args:
        hparams: the hyperparameters.
        vocab: the ``tokenizer.ggml.*`` keys, with ``hparams.n_vocab`` tokens; None for
            [`spm_dummy_vocab`][].

    Returns:
        Key to value, ready for [`reference.gguf.write_gguf`][reference.gguf.write_gguf].

    Raises:
        GGUFError: an architecture not in ``LLAMA_ARCHS``, a vocabulary whose size is not
            ``hparams.n_vocab``, or hyperparameters that llama.cpp would read back otherwise
            ([`gguf_representable_errors`][]: a RoPE mode other than the arch's, an untied
            Gemma/Gemma 2, a Gemma 2/3 attention scale other than the derived one, ...).

    Examples:
        >>> hp = LlamaHParams("llama", n_vocab=32, n_ctx_train=64, n_embd=16, n_layer=1,
        ...     n_head=2, n_head_kv=1, n_embd_head_k=8, n_embd_head_v=8, n_rot=8, n_ff=32,
        ...     f_norm_rms_eps=2.0**-16, n_ctx_orig_yarn=64)
        >>> md = llama_metadata(hp)
        >>> md["llama.attention.head_count_kv"], len(md["tokenizer.ggml.tokens"])
        (1, 32)
        >>> hparams_from_gguf("llama", md) == hp
        True
    """
    if hparams.arch not in LLAMA_ARCHS:
        raise GGUFError(
            f"unsupported architecture {hparams.arch!r}: expected one of {LLAMA_ARCHS}"
        )
    for error in gguf_representable_errors(hparams):
        raise GGUFError(f"{hparams.arch}: {error}")
    return _model_metadata(hparams, vocab)
# --8<-- [end:llama_metadata]


# --8<-- [start:gguf_representable_errors]
def gguf_representable_errors(hp: LlamaHParams) -> list[str]:
    """What in ``hp`` a GGUF of its architecture cannot say: llama.cpp would run another model.

    llama.cpp fixes some fields by architecture instead of reading them: the RoPE mode
    (``llama_model_rope_type``: normal for llama, NeoX for the others), Gemma/Gemma 2's tied
    output, Gemma 2/3's attention scale ([`gemma_attention_scale`][]), Gemma 2's SWA RoPE
    scale (``= rope_freq_scale_train``) and Gemma 3's (1: its RoPE scaling is for the global
    layers only); and it reads the soft-caps and the per-layer SWA pattern only for the
    archs that have them.

    Examples:
        >>> hp = LlamaHParams("llama", n_vocab=32, n_ctx_train=64, n_embd=16, n_layer=1,
        ...     n_head=2, n_head_kv=1, n_embd_head_k=8, n_embd_head_v=8, n_rot=8, n_ff=32,
        ...     f_norm_rms_eps=1e-5, rope_type=ROPE_TYPE_NEOX)
        >>> gguf_representable_errors(hp)
        ["rope_type=2, but llama.cpp's llama uses 0"]
    """
    arch, errors = hp.arch, []
    rope_type = ROPE_TYPE_NORM if arch == "llama" else ROPE_TYPE_NEOX
    if hp.rope_type != rope_type:
        errors.append(f"rope_type={hp.rope_type}, but llama.cpp's {arch} uses {rope_type}")
    if hp.n_expert and not hp.expert_weights_norm:
        errors.append(f"llama.cpp's {arch} normalises the chosen experts' weights (norm_w = "
                      "true): expert_weights_norm must be True")
    has_pattern = arch in ("gemma2", "gemma3")
    if not has_pattern and not all(hp.swa_layers):
        errors.append("a per-layer SWA pattern (swa_layers) needs gemma2 or gemma3")
    if not has_pattern and (hp.rope_freq_base_train_swa or hp.rope_freq_scale_train_swa):
        errors.append("a RoPE base or scale of the SWA layers needs gemma2 or gemma3")
    if arch != "gemma2" and hp.f_attn_logit_softcapping:
        errors.append("attention soft-capping needs gemma2")
    if not has_pattern and hp.f_final_logit_softcapping:
        errors.append("final logit soft-capping needs gemma2 or gemma3")
    if arch not in GEMMA_ARCHS:
        return errors
    if arch in ("gemma", "gemma2") and not hp.tied_output:
        errors.append("llama.cpp reuses token_embd as the output: tied_output must be True")
    if arch == "gemma":
        return errors
    scale = hp.f_attention_scale or 1.0 / math.sqrt(hp.n_embd_head_k)
    derived = gemma_attention_scale(arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_embd_head_k)
    if not math.isclose(scale, derived, rel_tol=1e-6):
        errors.append(f"attention scale {scale} is not {derived}, the one llama.cpp derives "
                      "(no GGUF key holds it: HF's query_pre_attn_scalar must be the head size, "
                      "or n_embd / n_head for the 27B layer counts)")
    swa_scale = 1.0 if arch == "gemma3" else hp.rope_freq_scale_train
    if hp.is_swa_any() and hp.rope_freq_scale_train_swa != swa_scale:
        errors.append(f"rope_freq_scale_train_swa={hp.rope_freq_scale_train_swa}, but "
                      f"llama.cpp's {arch} sets {swa_scale}")
    if arch == "gemma2" and not (hp.f_attn_logit_softcapping and hp.f_final_logit_softcapping):
        errors.append("gemma2 soft-caps attention and logits: both caps must be > 0")
    return errors
# --8<-- [end:gguf_representable_errors]


# --8<-- [start:mamba_metadata]
def mamba_metadata(hparams: MambaHParams, vocab: dict[str, Any] | None = None) -> dict[str, Any]:
    """The GGUF metadata that describes a ``mamba``/``mamba2`` model, as the converter writes.

    The inverse of [`mamba_hparams_from_gguf`][], through the same table
    (`GGUF_KEYS`). Like ``convert_hf_to_gguf``'s ``MambaModel`` / ``Mamba2Model`` it
    also writes ``feed_forward_length = 0`` and ``attention.head_count = 0`` (unused by the
    graph).

    Args:
        hparams: the hyperparameters.
        vocab: the ``tokenizer.ggml.*`` keys, with ``hparams.n_vocab`` tokens; None for
            [`spm_dummy_vocab`][].

    Returns:
        Key to value, ready for [`reference.gguf.write_gguf`][reference.gguf.write_gguf].

    Raises:
        GGUFError: another architecture, or a vocabulary whose size is not
            ``hparams.n_vocab``.

    Examples:
        >>> hp = MambaHParams("mamba2", n_vocab=32, n_embd=16, n_layer=1, n_ctx_train=64,
        ...     ssm_d_conv=4, ssm_d_inner=32, ssm_d_state=8, ssm_dt_rank=4, ssm_n_group=1,
        ...     f_norm_rms_eps=1e-5)
        >>> md = mamba_metadata(hp)
        >>> md["mamba2.ssm.group_count"], md["mamba2.ssm.time_step_rank"]
        (1, 4)
    """
    if hparams.arch not in MAMBA_ARCHS:
        raise GGUFError(
            f"unsupported architecture {hparams.arch!r}: expected 'mamba' or 'mamba2'"
        )
    unread = {f"{hparams.arch}.{key}": value for key, value in _MAMBA_UNREAD_KEYS.items()}
    return {**_model_metadata(hparams, vocab), **unread}
# --8<-- [end:mamba_metadata]
