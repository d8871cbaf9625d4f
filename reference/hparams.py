r"""Hyperparameters of a model, with llama.cpp's ``llama_hparams`` field names.

llama.cpp reads these from GGUF metadata keys of the form ``{arch}.{key}`` (for example
``llama.attention.head_count``) in ``llama_model::load_hparams``; a HF ``config.json`` is
mapped onto the same fields once, at load time (:mod:`reference.hf`). Everything downstream
(the model, the memory, the context) reads only this dataclass.

Derived sizes follow ``llama-hparams.h``:

$$
n_{gqa} = n_{head} / n_{head\_kv}, \qquad
n_{embd\_k\_gqa} = n_{embd\_head\_k} \cdot n_{head\_kv}.
$$

:func:`hparams_from_gguf` reads exactly the keys llama.cpp reads for the ``llama`` and
``qwen2`` architectures (``llama_model_base::load_hparams`` in ``src/llama-model.cpp``, then
``load_arch_hparams`` in ``src/models/llama.cpp`` / ``qwen2.cpp``; key names from
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
| ``{arch}.rope.scaling.factor`` (3) | ``rope_freq_scale_train = 1/factor`` | 1 |
| ``{arch}.rope.scaling.original_context_length`` | ``n_ctx_orig_yarn`` | ``n_ctx_train`` |
| ``{arch}.attention.sliding_window`` | ``n_swa``, ``swa_type`` (2) | 0, none |
| ``tokenizer.ggml.tokens`` (length), else ``{arch}.vocab_size`` | ``n_vocab`` | required |
| (arch) | ``rope_type``: llama NORM, qwen2 NEOX | |
| no ``output.weight`` tensor | ``tied_output`` | |

(1) Optional in llama.cpp's loader, but a Llama block cannot be built without it (tensor
creation fails there); here the missing key is named at once. (2) llama.cpp's ``llama`` and
``qwen2`` loaders do not read ``attention.sliding_window``: a file with that key runs with full
attention in llama.cpp. We read it, so that Mistral-style sliding-window models can be
described; oracle tests against llama.cpp must not set it. (3) Or the old key
``{arch}.rope.scale_linear``.

The selective state space models (``mamba``, ``mamba2``) have their own dataclass,
:class:`MambaHParams` (the ``ssm_*`` fields, ``n_embd_r()``/``n_embd_s()``), read by
:func:`mamba_hparams_from_gguf` from the ``{arch}.ssm.*`` keys.

Like llama.cpp, floats are held as float32 and a key may hold one value per layer (an
array of ``n_layer`` items); this dataclass holds one value, so per-layer arrays must be
uniform.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference.common import LlamarefError
from reference.gguf import GGUFError
from reference.ops.rope import ROPE_TYPE_NEOX, ROPE_TYPE_NORM  # noqa: F401  (re-exported)

# Sliding-window kinds, as llama.cpp's llama_swa_type.
SWA_TYPE_NONE = 0
SWA_TYPE_STANDARD = 1
SWA_TYPE_CHUNKED = 2
SWA_TYPE_SYMMETRIC = 3

# RoPE scaling kinds, as llama.cpp's llama_rope_scaling_type.
ROPE_SCALING_TYPE_NONE = 0
ROPE_SCALING_TYPE_LINEAR = 1
ROPE_SCALING_TYPE_YARN = 2
ROPE_SCALING_TYPE_NAMES = {  # LLAMA_ROPE_SCALING_TYPES in src/llama-model.cpp (less longrope)
    ROPE_SCALING_TYPE_NONE: "none",
    ROPE_SCALING_TYPE_LINEAR: "linear",
    ROPE_SCALING_TYPE_YARN: "yarn",
}


# --8<-- [start:is_masked_swa]
def is_masked_swa(n_swa: int, swa_type: int, p0: int, p1: int) -> bool:
    """Whether a cell at position ``p0`` is outside the sliding window of a token at ``p1``.

    Mirrors ``llama_hparams::is_masked_swa``. ``SWA_TYPE_STANDARD`` (Mistral) masks when
    ``p1 - p0 >= n_swa``, so a token sees itself and the ``n_swa - 1`` positions before it.

    Args:
        n_swa: window size (``hparams.n_swa``).
        swa_type: one of ``SWA_TYPE_*`` from :mod:`reference.hparams`.
        p0: position of the key (the cell).
        p1: position of the query (the token).

    Returns:
        True when the window hides the cell from the token.

    Examples:
        >>> is_masked_swa(4, SWA_TYPE_STANDARD, 6, 9), is_masked_swa(4, SWA_TYPE_STANDARD, 5, 9)
        (False, True)
        >>> is_masked_swa(4, SWA_TYPE_NONE, 0, 100)
        False
    """
    if swa_type == SWA_TYPE_STANDARD:
        return p1 - p0 >= n_swa
    if swa_type == SWA_TYPE_CHUNKED:
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == SWA_TYPE_SYMMETRIC:
        return abs(p1 - p0) > n_swa // 2
    return False
# --8<-- [end:is_masked_swa]


class HParamsError(LlamarefError, ValueError):
    """Hyperparameters that cannot describe a model (a head count that does not divide, ...)."""


# --8<-- [start:hparams_errors]
def hparams_errors(hp: LlamaHParams) -> list[str]:
    """What is inconsistent in ``hp``; an empty list when it describes a model.

    The rules the forward pass relies on: positive sizes, whole query heads per KV head, an
    even number of rotated dims that fits in a head, and a sliding window exactly when a
    window type is set (``n_swa = 0`` with a window type would mask every cell).

    Examples:
        >>> hp = LlamaHParams(arch="llama", n_vocab=8, n_ctx_train=16, n_embd=8, n_layer=1,
        ...     n_head=2, n_head_kv=2, n_embd_head_k=4, n_embd_head_v=4, n_rot=4, n_ff=8,
        ...     f_norm_rms_eps=1e-5)
        >>> hparams_errors(hp)
        []
        >>> import dataclasses
        >>> dataclasses.replace(hp, n_head_kv=3)
        Traceback (most recent call last):
        ...
        reference.hparams.HParamsError: n_head=2 is not a multiple of n_head_kv=3
    """
    sizes = ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_embd_head_k",
             "n_embd_head_v", "n_ff")
    errors = [f"{name} must be positive, got {getattr(hp, name)}"
              for name in sizes if getattr(hp, name) <= 0]
    if errors:
        return errors
    if hp.n_head % hp.n_head_kv:
        errors.append(f"n_head={hp.n_head} is not a multiple of n_head_kv={hp.n_head_kv}")
    if hp.n_rot < 0 or hp.n_rot % 2 or hp.n_rot > hp.n_embd_head_k:
        errors.append(f"n_rot={hp.n_rot} must be even and at most n_embd_head_k="
                      f"{hp.n_embd_head_k}")
    if hp.n_swa < 0 or (hp.n_swa > 0) != (hp.swa_type != SWA_TYPE_NONE):
        errors.append(f"n_swa={hp.n_swa} and swa_type={hp.swa_type} disagree: a window "
                      "needs n_swa > 0 and a window type, no window needs both unset")
    return errors
# --8<-- [end:hparams_errors]


@dataclass(frozen=True)
class LlamaHParams:
    """The hyperparameters the Llama-family forward pass needs (``llama_hparams``).

    Attributes:
        arch: GGUF ``general.architecture`` (``"llama"`` or ``"qwen2"``).
        n_vocab: vocabulary size (rows of ``token_embd``).
        n_ctx_train: context length the model was trained with.
        n_embd: width of the residual stream.
        n_layer: number of transformer blocks.
        n_head: query heads.
        n_head_kv: key/value heads (GQA when smaller than ``n_head``).
        n_embd_head_k: width of one key (and query) head.
        n_embd_head_v: width of one value head.
        n_rot: number of rotated dimensions per head (``rope.dimension_count``).
        n_ff: hidden width of the feed-forward network.
        f_norm_rms_eps: epsilon of every ``rms_norm``.
        rope_type: ``ROPE_TYPE_NORM`` (llama) or ``ROPE_TYPE_NEOX`` (qwen2); fixed by arch.
        rope_freq_base_train: RoPE base frequency (``rope.freq_base``).
        rope_freq_scale_train: RoPE frequency scale (``1 / rope.scaling.factor``).
        rope_scaling_type_train: one of ``ROPE_SCALING_TYPE_*``.
        n_ctx_orig_yarn: original context of YaRN (``rope.scaling.original_context_length``).
        yarn_ext_factor: YaRN extrapolation mix; negative means "derive from scaling type".
        yarn_attn_factor: YaRN attention factor.
        yarn_beta_fast: YaRN high-correction dim.
        yarn_beta_slow: YaRN low-correction dim.
        n_swa: sliding-window size; 0 means no sliding window.
        swa_type: one of ``SWA_TYPE_*``.
        f_attention_scale: KQ scale; 0 means ``1 / sqrt(n_embd_head_k)``.
        tied_output: True when the model has no ``output.weight`` and reuses ``token_embd``.
    """

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    n_ff: int
    f_norm_rms_eps: float
    rope_type: int = ROPE_TYPE_NORM
    rope_freq_base_train: float = 10000.0
    rope_freq_scale_train: float = 1.0
    rope_scaling_type_train: int = ROPE_SCALING_TYPE_NONE
    n_ctx_orig_yarn: int = 0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    n_swa: int = 0
    swa_type: int = SWA_TYPE_NONE
    f_attention_scale: float = 0.0
    tied_output: bool = False

    def __post_init__(self) -> None:
        for error in hparams_errors(self):
            raise HParamsError(error)

    def n_gqa(self) -> int:
        """Query heads per key/value head."""
        return self.n_head // self.n_head_kv

    def n_embd_k_gqa(self) -> int:
        """Width of all key heads of one token: ``n_embd_head_k * n_head_kv``."""
        return self.n_embd_head_k * self.n_head_kv

    def n_embd_v_gqa(self) -> int:
        """Width of all value heads of one token: ``n_embd_head_v * n_head_kv``."""
        return self.n_embd_head_v * self.n_head_kv


# --8<-- [start:rope_cparams]
def rope_cparams(hparams: LlamaHParams) -> dict:
    r"""The keyword arguments of ``rope_ext`` for this model, as ``llama_context`` derives them.

    Mirrors the constructor of ``llama_context`` (``cparams``): no scaling type means
    ``freq_scale = 1``; a negative ``yarn_ext_factor`` means 1 for YaRN and 0 otherwise;
    with YaRN the attention factor is reset so that ``rope_ext``'s own
    $1 + 0.1 \ln(1/s)$ magnitude correction is the only one applied; ``n_ctx_orig`` is
    ``n_ctx_orig_yarn``, or ``n_ctx_train`` when that is 0.

    Examples:
        >>> hp = LlamaHParams(arch="llama", n_vocab=8, n_ctx_train=64, n_embd=8, n_layer=1,
        ...     n_head=2, n_head_kv=1, n_embd_head_k=4, n_embd_head_v=4, n_rot=4, n_ff=16,
        ...     f_norm_rms_eps=1e-5, rope_freq_scale_train=0.5)
        >>> p = rope_cparams(hp)
        >>> p["freq_scale"], p["ext_factor"], p["n_ctx_orig"], p["n_dims"]
        (1.0, 0.0, 64, 4)
    """
    scaling = hparams.rope_scaling_type_train
    freq_scale = 1.0 if scaling == ROPE_SCALING_TYPE_NONE else hparams.rope_freq_scale_train
    ext_factor = hparams.yarn_ext_factor
    if ext_factor < 0.0:  # negative means "not set"
        ext_factor = 1.0 if scaling == ROPE_SCALING_TYPE_YARN else 0.0
    attn_factor = hparams.yarn_attn_factor
    if ext_factor != 0.0:
        # get_mscale(factor, 1) / (1 + 0.1 ln factor) == 1: rope_ext applies the correction
        attn_factor = 1.0
    return dict(
        n_dims=hparams.n_rot,
        mode=hparams.rope_type,
        n_ctx_orig=hparams.n_ctx_orig_yarn or hparams.n_ctx_train,
        freq_base=hparams.rope_freq_base_train,
        freq_scale=freq_scale,
        ext_factor=ext_factor,
        attn_factor=attn_factor,
        beta_fast=hparams.yarn_beta_fast,
        beta_slow=hparams.yarn_beta_slow,
    )
# --8<-- [end:rope_cparams]


_REQUIRED = object()
_U32_MAX = 2**32 - 1


def _get(metadata: dict[str, Any], key: str, default: Any, kind: type, n_layer: int = 0) -> Any:
    """One value of ``metadata[key]`` of Python type ``kind`` (a uniform per-layer array ok)."""
    if key not in metadata:
        if default is _REQUIRED:
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


def _n_vocab(metadata: dict[str, Any], arch: str) -> int:
    """The vocabulary size: the token list's length, else ``{arch}.vocab_size``."""
    if "tokenizer.ggml.tokens" in metadata:
        tokens = metadata["tokenizer.ggml.tokens"]
        if not isinstance(tokens, list):
            raise GGUFError("key 'tokenizer.ggml.tokens' must be an array of strings")
        return len(tokens)
    return _get(metadata, f"{arch}.vocab_size", _REQUIRED, int)


# --8<-- [start:hparams_from_gguf]
def hparams_from_gguf(
    arch: str, metadata: dict[str, Any], tensor_names: Iterable[str] | None = None
) -> LlamaHParams | MambaHParams:
    """Hyperparameters from GGUF metadata, as ``llama_model::load_hparams`` reads them.

    See the table of keys in the module docstring; ``mamba`` and ``mamba2`` go to
    :func:`mamba_hparams_from_gguf`.

    Args:
        arch: ``general.architecture``: ``"llama"``, ``"qwen2"``, ``"mamba"`` or ``"mamba2"``.
        metadata: the GGUF key/value pairs (``GGUFFile.metadata``).
        tensor_names: the file's tensor names; ``tied_output`` is True when they lack
            ``output.weight``. None leaves ``tied_output`` False.

    Returns:
        The :class:`LlamaHParams` (:class:`MambaHParams` for ``mamba``/``mamba2``).

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
    if arch not in ("llama", "qwen2"):
        raise GGUFError(
            f"unsupported architecture {arch!r}: expected 'llama', 'qwen2', 'mamba' or 'mamba2'"
        )
    a = arch
    n_layer = _get(metadata, f"{a}.block_count", _REQUIRED, int)
    if n_layer == 0:
        raise GGUFError(f"key '{a}.block_count' must be > 0")
    n_embd = _get(metadata, f"{a}.embedding_length", _REQUIRED, int)
    n_head = _get(metadata, f"{a}.attention.head_count", _REQUIRED, int, n_layer)
    n_head_kv = _get(metadata, f"{a}.attention.head_count_kv", n_head, int, n_layer)
    if n_head == 0 or n_head_kv == 0 or n_head % n_head_kv:
        raise GGUFError(f"n_head={n_head} must be a positive multiple of n_head_kv={n_head_kv}")
    n_embd_head_k = _get(metadata, f"{a}.attention.key_length", n_embd // n_head, int)
    n_embd_head_v = _get(metadata, f"{a}.attention.value_length", n_embd // n_head, int)
    n_rot = _get(metadata, f"{a}.rope.dimension_count", n_embd_head_k, int)
    if arch == "llama" and n_rot != n_embd_head_k:
        raise GGUFError(f"invalid n_rot: {n_rot}, expected {n_embd_head_k} (llama)")
    n_ctx_train = _get(metadata, f"{a}.context_length", _REQUIRED, int)

    scaling = _get(metadata, f"{a}.rope.scaling.type", "linear", str)
    names = {name: t for t, name in ROPE_SCALING_TYPE_NAMES.items()}
    if scaling not in names:
        raise GGUFError(f"key '{a}.rope.scaling.type': unsupported RoPE scaling {scaling!r}")
    factor = _get(metadata, f"{a}.rope.scaling.factor", None, float)
    if factor is None:
        factor = _get(metadata, f"{a}.rope.scale_linear", 0.0, float)  # the old key name
    freq_scale = 1.0 if factor == 0.0 else float(np.float32(1.0) / np.float32(factor))

    n_swa = _get(metadata, f"{a}.attention.sliding_window", 0, int)
    n_vocab = _n_vocab(metadata, a)
    try:
        return LlamaHParams(
            arch=arch,
            n_vocab=n_vocab,
            n_ctx_train=n_ctx_train,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_embd_head_k=n_embd_head_k,
            n_embd_head_v=n_embd_head_v,
            n_rot=n_rot,
            n_ff=_get(metadata, f"{a}.feed_forward_length", _REQUIRED, int, n_layer),
            f_norm_rms_eps=_get(
                metadata, f"{a}.attention.layer_norm_rms_epsilon", _REQUIRED, float
            ),
            rope_type=ROPE_TYPE_NORM if arch == "llama" else ROPE_TYPE_NEOX,
            rope_freq_base_train=_get(metadata, f"{a}.rope.freq_base", 10000.0, float),
            rope_freq_scale_train=freq_scale,
            rope_scaling_type_train=names[scaling],
            n_ctx_orig_yarn=_get(
                metadata, f"{a}.rope.scaling.original_context_length", n_ctx_train, int
            ),
            n_swa=n_swa,
            swa_type=SWA_TYPE_STANDARD if n_swa else SWA_TYPE_NONE,
            tied_output=tensor_names is not None and "output.weight" not in set(tensor_names),
        )
    except HParamsError as e:
        raise GGUFError(f"inconsistent hyperparameters: {e}") from e


# --8<-- [end:hparams_from_gguf]


# ---------------------------------------------------------------------------------------------
# Mamba and Mamba-2
# ---------------------------------------------------------------------------------------------

# --8<-- [start:MAMBA_ARCHS]
MAMBA_ARCHS = ("mamba", "mamba2")  # GGUF architectures of selective state space models
# --8<-- [end:MAMBA_ARCHS]


# --8<-- [start:mamba_hparams_errors]
def mamba_hparams_errors(hp: MambaHParams) -> list[str]:
    """What is inconsistent in ``hp``; an empty list when it describes a Mamba model.

    The rules the forward pass relies on (the ``GGML_ASSERT`` checks of ``build_mamba_layer``,
    ``build_mamba2_layer`` and ``ggml_ssm_scan``): positive sizes; for ``mamba`` no groups
    (``ssm_n_group = 0``: llama.cpp does not read the key, and the conv state holds ``x``
    only); for ``mamba2`` at least one group, whole heads (``ssm_dt_rank`` is the head count
    and divides ``ssm_d_inner``) and whole heads per group, and no ``ssm_dt_b_c_rms`` (a
    FalconMamba flag that ``mamba2`` does not read).

    Examples:
        >>> hp = MambaHParams(arch="mamba2", n_vocab=16, n_embd=8, n_layer=1, n_ctx_train=64,
        ...     ssm_d_conv=4, ssm_d_inner=16, ssm_d_state=4, ssm_dt_rank=4, ssm_n_group=2,
        ...     f_norm_rms_eps=1e-5)
        >>> mamba_hparams_errors(hp)
        []
        >>> import dataclasses
        >>> dataclasses.replace(hp, ssm_dt_rank=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.hparams.HParamsError: mamba2: ssm_d_inner=16 is not a multiple of the head ...
    """
    if hp.arch not in MAMBA_ARCHS:
        return [f"arch {hp.arch!r} is not one of {MAMBA_ARCHS}"]
    sizes = ("n_vocab", "n_embd", "n_layer", "ssm_d_conv", "ssm_d_inner", "ssm_d_state",
             "ssm_dt_rank")
    errors = [f"{name} must be positive, got {getattr(hp, name)}"
              for name in sizes if getattr(hp, name) <= 0]
    if errors:
        return errors
    if hp.arch == "mamba" and hp.ssm_n_group != 0:
        errors.append(f"mamba: ssm_n_group must be 0 (no groups), got {hp.ssm_n_group}")
    if hp.arch == "mamba2":
        n_head, n_group = hp.ssm_dt_rank, hp.ssm_n_group
        if n_group <= 0:
            errors.append(f"mamba2: ssm_n_group must be positive, got {n_group}")
        elif hp.ssm_d_inner % n_head:
            errors.append(f"mamba2: ssm_d_inner={hp.ssm_d_inner} is not a multiple of the "
                          f"head count ssm_dt_rank={n_head}")
        elif n_head % n_group:
            errors.append(f"mamba2: the head count ssm_dt_rank={n_head} is not a multiple "
                          f"of ssm_n_group={n_group}")
        if hp.ssm_dt_b_c_rms:
            errors.append("mamba2: ssm_dt_b_c_rms is a mamba (FalconMamba) flag")
    return errors
# --8<-- [end:mamba_hparams_errors]


# --8<-- [start:MambaHParams]
@dataclass(frozen=True)
class MambaHParams:
    r"""The hyperparameters of Mamba and Mamba-2 (``llama_hparams``' ``ssm_*`` fields).

    Attributes:
        arch: ``"mamba"`` (Mamba-1, selective scan with a per-channel $A$) or ``"mamba2"``
            (SSD: a scalar $A$ per head, heads of ``ssm_d_inner / ssm_dt_rank`` channels).
        n_vocab: vocabulary size.
        n_embd: width of the residual stream ($d_{model}$).
        n_layer: number of blocks.
        n_ctx_train: context length of the GGUF (unused by a recurrent model).
        ssm_d_conv: width of the causal depthwise convolution (4 in every released model).
        ssm_d_inner: width of the SSM ($d_{inner}$, ``expand * n_embd``).
        ssm_d_state: state size $N$ per channel.
        ssm_dt_rank: Mamba-1: rank of the $\Delta$ projection; Mamba-2: the head count.
        ssm_n_group: Mamba-2: groups of heads sharing $B$ and $C$; 0 for Mamba-1.
        ssm_dt_b_c_rms: Mamba-1 (FalconMamba): RMS-normalize $\Delta$, $B$, $C$.
        f_norm_rms_eps: epsilon of every ``rms_norm``.
        tied_output: True when the model has no ``output.weight`` and reuses ``token_embd``.

    The memory sizes its rows with :meth:`n_embd_r` and :meth:`n_embd_s`, as
    ``llama_hparams`` does.

    Examples:
        >>> hp = MambaHParams(arch="mamba", n_vocab=16, n_embd=8, n_layer=2, n_ctx_train=64,
        ...     ssm_d_conv=4, ssm_d_inner=16, ssm_d_state=4, ssm_dt_rank=2,
        ...     f_norm_rms_eps=1e-5)
        >>> hp.n_embd_r(), hp.n_embd_s()
        (48, 64)
    """

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    ssm_d_conv: int
    ssm_d_inner: int
    ssm_d_state: int
    ssm_dt_rank: int
    f_norm_rms_eps: float
    ssm_n_group: int = 0
    ssm_dt_b_c_rms: bool = False
    tied_output: bool = False

    def __post_init__(self) -> None:
        for error in mamba_hparams_errors(self):
            raise HParamsError(error)

    def n_embd_r(self) -> int:
        r"""Values of one conv-state row: $(d_{conv} - 1)(d_{inner} + 2 n_{group} N)$.

        ``llama_hparams::n_embd_r``: the last $d_{conv} - 1$ inputs of the convolution for
        each of its channels (``x`` only for Mamba-1, ``x``, ``B`` and ``C`` for Mamba-2).
        """
        conv_dim = self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state
        return (self.ssm_d_conv - 1) * conv_dim

    def n_embd_s(self) -> int:
        r"""Values of one ssm-state row: $N \cdot d_{inner}$ (``llama_hparams::n_embd_s``)."""
        return self.ssm_d_state * self.ssm_d_inner

    def conv_dim(self) -> int:
        """Channels of the convolution: ``ssm_d_inner + 2 * ssm_n_group * ssm_d_state``."""
        return self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state

    def n_head(self) -> int:
        """Heads of the scan: ``ssm_d_inner`` for Mamba-1 (head_dim 1), ``ssm_dt_rank`` for
        Mamba-2 (``build_mamba_layer`` / ``build_mamba2_layer``)."""
        return self.ssm_d_inner if self.arch == "mamba" else self.ssm_dt_rank

    def head_dim(self) -> int:
        """Channels per head: ``ssm_d_inner / n_head()``."""
        return self.ssm_d_inner // self.n_head()
# --8<-- [end:MambaHParams]


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
        The :class:`MambaHParams`.

    Raises:
        GGUFError: another architecture, a missing required key (named), a value of the
            wrong type, sizes that cannot describe a model (:func:`mamba_hparams_errors`).

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
    a = arch
    n_layer = _get(metadata, f"{a}.block_count", _REQUIRED, int)
    if n_layer == 0:
        raise GGUFError(f"key '{a}.block_count' must be > 0")
    n_vocab = _n_vocab(metadata, a)
    try:
        return MambaHParams(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=_get(metadata, f"{a}.embedding_length", _REQUIRED, int),
            n_layer=n_layer,
            n_ctx_train=_get(metadata, f"{a}.context_length", _REQUIRED, int),
            ssm_d_conv=_get(metadata, f"{a}.ssm.conv_kernel", _REQUIRED, int),
            ssm_d_inner=_get(metadata, f"{a}.ssm.inner_size", _REQUIRED, int),
            ssm_d_state=_get(metadata, f"{a}.ssm.state_size", _REQUIRED, int),
            ssm_dt_rank=_get(metadata, f"{a}.ssm.time_step_rank", _REQUIRED, int),
            ssm_n_group=(
                _get(metadata, f"{a}.ssm.group_count", _REQUIRED, int) if a == "mamba2" else 0
            ),
            ssm_dt_b_c_rms=(
                _get(metadata, f"{a}.ssm.dt_b_c_rms", False, bool) if a == "mamba" else False
            ),
            f_norm_rms_eps=_get(
                metadata, f"{a}.attention.layer_norm_rms_epsilon", _REQUIRED, float
            ),
            tied_output=tensor_names is not None and "output.weight" not in set(tensor_names),
        )
    except HParamsError as e:
        raise GGUFError(f"inconsistent hyperparameters: {e}") from e
# --8<-- [end:mamba_hparams_from_gguf]
