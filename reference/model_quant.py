r"""Making a model file: which ggml type every tensor gets in a ``Q4_K_M`` (etc.) file.

``llama-quantize model-f32.gguf model-Q4_K_M.gguf Q4_K_M`` does not quantize every weight to
Q4_K. The *file type* (``llama_ftype``, ``general.file_type`` in the file) names a **mix**:
a default block type, and rules that give some tensors more bits (the value projections and
the FFN down projections of the first and last layers, the output matrix) or fewer. This
module mirrors ``src/llama-quant.cpp`` at the pinned commit, without an importance matrix:

- [`llama_ftype_get_default_type`][] is the default type of each file type;
- [`tensor_allows_quantization`][] says which tensors are quantized at all (matrices whose
  name ends in ``weight``; never a norm, a 1-D tensor or a router);
- [`llama_tensor_get_type_impl`][] is the mix: the type a tensor gets from its *category*
  (its name), the file type, its layer and the model's hyperparameters;
- [`tensor_type_fallback`][] demotes a type whose blocks do not fit a row (a row length that
  is not a multiple of 256 cannot hold K-quant super-blocks);
- [`tensor_types`][] visits the tensors in llama.cpp's order (the order of the counters
  ``i_attention_wv`` and ``i_ffn_down``) and returns the plan; [`quantize_model`][] carries
  it out with [`reference.quants.quantize`][reference.quants.quantize] (byte-identical to
  ggml's ``quantize_row_*_ref``) and sets ``general.file_type`` and
  ``general.quantization_version`` as llama.cpp writes them.

The result is byte for byte the file ``llama_model_quantize`` writes, tensor order and
metadata included (tested against llama.cpp through llama-cpp-python). The file types whose
types this project can write are those of `FTYPES`; the others (the I-quants, TQ, MXFP4
and ``Q2_K_S``, which needs an importance matrix) are refused by name.

Only the rules that a file type of `FTYPES` can reach are written out; the I-quant branches of
``llama_tensor_get_type_impl`` are left out, the Falcon, 70B and 8-expert branches are kept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

from reference.common import QuantError
from reference.gguf import GGUFValue
from reference.quants import QUANTIZE, QuantizedTensor, dequantize, quantize

T = GGMLQuantizationType
F = LlamaFileType

GGML_QNT_VERSION = 2  # ggml.h: "bump this on quantization format changes"


class ModelQuantError(QuantError):
    """A model file cannot be quantized as asked: a file type or tensor type this project
    cannot write, a quantized source without ``allow_requantize``, missing hyperparameters."""


# --8<-- [start:FTYPES]
# llama-quantize's names (tools/quantize/quantize.cpp, QUANT_OPTIONS) of the file types whose
# every tensor type reference.quants can write; "Q3_K", "Q4_K", "Q5_K" are its aliases.
FTYPES: dict[str, LlamaFileType] = {
    "Q4_0": F.MOSTLY_Q4_0, "Q4_1": F.MOSTLY_Q4_1, "Q5_0": F.MOSTLY_Q5_0,
    "Q5_1": F.MOSTLY_Q5_1, "Q2_K": F.MOSTLY_Q2_K,
    "Q3_K": F.MOSTLY_Q3_K_M, "Q3_K_S": F.MOSTLY_Q3_K_S, "Q3_K_M": F.MOSTLY_Q3_K_M,
    "Q3_K_L": F.MOSTLY_Q3_K_L, "Q4_K": F.MOSTLY_Q4_K_M, "Q4_K_S": F.MOSTLY_Q4_K_S,
    "Q4_K_M": F.MOSTLY_Q4_K_M, "Q5_K": F.MOSTLY_Q5_K_M, "Q5_K_S": F.MOSTLY_Q5_K_S,
    "Q5_K_M": F.MOSTLY_Q5_K_M, "Q6_K": F.MOSTLY_Q6_K, "Q8_0": F.MOSTLY_Q8_0,
    "F16": F.MOSTLY_F16, "BF16": F.MOSTLY_BF16, "F32": F.ALL_F32,
}
FTYPE_ALIASES = ("Q3_K", "Q4_K", "Q5_K")
# the rest of QUANT_OPTIONS: llama-quantize writes them, this project cannot (yet)
REFUSED_FTYPES = (
    "Q1_0", "Q2_0", "MXFP4_MOE", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
    "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "Q2_K_S", "IQ3_XXS", "IQ3_S", "IQ3_M", "IQ3_XS",
    "IQ4_NL", "IQ4_XS", "COPY",
)
# --8<-- [end:FTYPES]

# --8<-- [start:default_type]
DEFAULT_TYPES: dict[LlamaFileType, GGMLQuantizationType] = {
    F.MOSTLY_Q4_0: T.Q4_0, F.MOSTLY_Q4_1: T.Q4_1, F.MOSTLY_Q8_0: T.Q8_0,
    F.MOSTLY_Q5_0: T.Q5_0, F.MOSTLY_Q5_1: T.Q5_1,
    F.MOSTLY_F16: T.F16, F.MOSTLY_BF16: T.BF16, F.ALL_F32: T.F32,
    F.MOSTLY_Q2_K: T.Q2_K,
    F.MOSTLY_Q3_K_S: T.Q3_K, F.MOSTLY_Q3_K_M: T.Q3_K, F.MOSTLY_Q3_K_L: T.Q3_K,
    F.MOSTLY_Q4_K_S: T.Q4_K, F.MOSTLY_Q4_K_M: T.Q4_K,
    F.MOSTLY_Q5_K_S: T.Q5_K, F.MOSTLY_Q5_K_M: T.Q5_K,
    F.MOSTLY_Q6_K: T.Q6_K,
}


def llama_ftype_get_default_type(ftype: LlamaFileType) -> GGMLQuantizationType:
    """The type most tensors of a file type get (``llama_ftype_get_default_type``).

    Examples:
        >>> llama_ftype_get_default_type(LlamaFileType.MOSTLY_Q4_K_M).name
        'Q4_K'
    """
    return DEFAULT_TYPES[parse_ftype(ftype)]
# --8<-- [end:default_type]


def parse_ftype(ftype: str | int | LlamaFileType) -> LlamaFileType:
    """A file type from llama-quantize's name (any case: ``"q4_k_m"``) or its number (``15``).

    Raises:
        ModelQuantError: a name or number that is not a file type of `FTYPES`; a file type
            that llama-quantize writes but this project cannot is named as such.

    Examples:
        >>> parse_ftype("q4_k_m"), parse_ftype(18).name
        (<LlamaFileType.MOSTLY_Q4_K_M: 15>, 'MOSTLY_Q6_K')
        >>> parse_ftype("IQ2_XXS")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.model_quant.ModelQuantError: file type IQ2_XXS is not supported: ...
    """
    if isinstance(ftype, str) and not ftype.strip().lstrip("-").isdigit():
        name = ftype.strip().upper()
        if name in FTYPES:
            return FTYPES[name]
        if name in REFUSED_FTYPES:
            raise ModelQuantError(
                f"file type {name} is not supported: llama-quantize writes it, but its tensor "
                f"types cannot be written here; supported: {', '.join(FTYPES)}")
        raise ModelQuantError(
            f"unknown file type {ftype!r}; supported: {', '.join(FTYPES)}")
    try:
        value = int(ftype)
    except (TypeError, ValueError):
        raise ModelQuantError(f"file type must be a name or a number, got {ftype!r}") from None
    if value not in DEFAULT_TYPES:
        names = {int(v): k for k, v in FTYPES.items()}
        raise ModelQuantError(
            f"file type {value} is not supported; supported: "
            + ", ".join(f"{v} ({names[v]})" for v in sorted(names)))
    return LlamaFileType(value)


def ftype_name(ftype: LlamaFileType) -> str:
    """llama-quantize's name of a file type of `FTYPES` (``"Q4_K_M"``, never an alias).

    Examples:
        >>> ftype_name(LlamaFileType.MOSTLY_Q4_K_M)
        'Q4_K_M'
    """
    return next(k for k, v in FTYPES.items() if v == ftype and k not in FTYPE_ALIASES)


def parse_ggml_type(name: str) -> GGMLQuantizationType:
    """A ggml type from its name in any case (``--output-tensor-type q8_0``).

    Raises:
        ModelQuantError: not a ggml type that [`reference.quants.quantize`][] can write.
    """
    t = getattr(T, str(name).upper(), None)
    if not isinstance(t, GGMLQuantizationType) or t not in QUANTIZE:
        raise ModelQuantError(
            f"unknown or unsupported tensor type {name!r}; supported: "
            + ", ".join(x.name for x in QUANTIZE))
    return t


# ---------------------------------------------------------------------------------------------
# Which tensors are quantized, and their categories
# ---------------------------------------------------------------------------------------------

# --8<-- [start:QuantizeParams]
@dataclass(frozen=True)
class QuantizeParams:
    """The options of ``llama_model_quantize_params`` that apply without an importance matrix.

    Attributes:
        output_tensor_type: ``--output-tensor-type``: the type of ``output.weight`` (and of a
            tied ``token_embd.weight``); None: the mix decides.
        token_embedding_type: ``--token-embedding-type``: the type of ``token_embd.weight``.
        quantize_output_tensor: False is ``--leave-output-tensor``: ``output.weight`` is
            copied as it is.
        pure: ``--pure``: every quantized tensor gets the default type (no mix), only the
            fallback for rows that do not fit still applies.
        allow_requantize: ``--allow-requantize``: quantized sources are dequantized and
            quantized again (refused by default, as llama.cpp).
    """

    output_tensor_type: GGMLQuantizationType | None = None
    token_embedding_type: GGMLQuantizationType | None = None
    quantize_output_tensor: bool = True
    pure: bool = False
    allow_requantize: bool = False
# --8<-- [end:QuantizeParams]


# --8<-- [start:tensor_category]
CATEGORY_SUBSTRINGS = (  # first match wins, as in tensor_get_category
    ("attn_qkv.weight", "ATTENTION_QKV"), ("attn_kv_b.weight", "ATTENTION_KV_B"),
    ("attn_v.weight", "ATTENTION_V"), ("attn_k.weight", "ATTENTION_K"),
    ("attn_q.weight", "ATTENTION_Q"), ("attn_output.weight", "ATTENTION_OUTPUT"),
    ("ffn_up", "FFN_UP"), ("ffn_gate", "FFN_GATE"), ("ffn_down", "FFN_DOWN"),
)
ATTN_V_LIKE = ("ATTENTION_V", "ATTENTION_QKV", "ATTENTION_KV_B")  # the sensitive ones


def tensor_category(name: str) -> str:
    """The broad category of a tensor, by name (``tensor_get_category``).

    Examples:
        >>> tensor_category("blk.3.attn_v.weight"), tensor_category("blk.0.ffn_down_exps.weight")
        ('ATTENTION_V', 'FFN_DOWN')
    """
    if name == "output.weight":
        return "OUTPUT"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "TOKEN_EMBD"
    return next((cat for part, cat in CATEGORY_SUBSTRINGS if part in name), "OTHER")
# --8<-- [end:tensor_category]


# --8<-- [start:tensor_allows_quantization]
NEVER_QUANTIZED = (  # substrings of tensor names that stay as they are
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight",
    "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight",
    "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight",
    "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight",
    ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
    ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)


def n_dims(shape: tuple[int, ...]) -> int:
    """``ggml_n_dims``: the dimensions up to the last one (in ggml's order) that is not 1.

    Examples:
        >>> n_dims((1, 256)), n_dims((32, 256)), n_dims((4, 1, 8))
        (1, 2, 3)
    """
    ne = tuple(reversed(shape))  # ggml order
    return max([i + 1 for i, n in enumerate(ne) if n > 1], default=1)


def tensor_allows_quantization(name: str, shape: tuple[int, ...],
                               params: QuantizeParams = QuantizeParams()) -> bool:
    """Whether llama-quantize may change a tensor's type (``tensor_allows_quantization``).

    A matrix (2-D, or 3-D for experts) whose name ends in ``weight``, that is no norm, no
    MoE router, not ``output.weight`` under ``--leave-output-tensor``, and none of the small
    tensors of `NEVER_QUANTIZED`; every other tensor is copied as it is.

    Examples:
        >>> tensor_allows_quantization("blk.0.attn_q.weight", (64, 64))
        True
        >>> tensor_allows_quantization("blk.0.attn_norm.weight", (64,))
        False
    """
    if n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    if name == "output.weight" and not params.quantize_output_tensor:
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(part in name for part in NEVER_QUANTIZED)
# --8<-- [end:tensor_allows_quantization]


# ---------------------------------------------------------------------------------------------
# The mix
# ---------------------------------------------------------------------------------------------

# --8<-- [start:QuantizeState]
@dataclass
class QuantizeState:
    """``quantize_state_impl``: what the mix knows of the model, and its counters.

    ``i_attention_wv`` and ``i_ffn_down`` count the value and FFN-down matrices seen so far
    (in the visiting order of [`tensor_order`][]); they stand for the layer index, so the
    rule "more bits in the first and last eighth of the layers" needs no name parsing.
    """

    arch: str
    n_layer: int
    n_gqa: int  # n_head / n_head_kv of layer 0
    n_expert: int = 0
    is_70b: bool = False  # llama.cpp's LLM_TYPE_70B (80 layers of llama with GQA, or qwen2)
    has_tied_embeddings: bool = True  # until output.weight is seen
    n_attention_wv: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    n_fallback: int = 0
    fallbacks: list = field(default_factory=list)  # (name, ncols, target, fallback)
# --8<-- [end:QuantizeState]


def _scalar(value: Any) -> Any:
    """A per-layer array of hyperparameters (``head_count_kv`` of some models) -> layer 0."""
    return value[0] if isinstance(value, (list, np.ndarray)) else value


def quantize_state(metadata: dict[str, Any], names: list[str]) -> QuantizeState:
    """The state of ``llama_model_quantize_impl`` for a file: hyperparameters and counts.

    Raises:
        ModelQuantError: ``general.architecture`` or ``{arch}.block_count`` missing.
    """
    md = {k: v.value if isinstance(v, GGUFValue) else v for k, v in metadata.items()}
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or f"{arch}.block_count" not in md:
        raise ModelQuantError(
            "the metadata needs general.architecture and {arch}.block_count to choose the "
            f"tensor types (architecture: {arch!r})")
    n_layer = int(_scalar(md[f"{arch}.block_count"]))
    n_head = int(_scalar(md.get(f"{arch}.attention.head_count", 0)))
    n_head_kv = int(_scalar(md.get(f"{arch}.attention.head_count_kv", n_head)))
    state = QuantizeState(
        arch=arch, n_layer=n_layer, n_gqa=n_head // n_head_kv if n_head_kv else 0,
        n_expert=int(_scalar(md.get(f"{arch}.expert_count", 0))),
        is_70b=n_layer == 80 and (arch == "qwen2" or arch == "llama" and n_head != n_head_kv))
    # init_quantize_state_counters
    state.n_attention_wv = sum(tensor_category(n) in ATTN_V_LIKE for n in names)
    state.has_tied_embeddings = "output.weight" not in names
    return state


# --8<-- [start:use_more_bits]
def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers that get more bits: the first eighth, the last eighth, and every third
    layer in between (``use_more_bits`` in ``llama_tensor_get_type_impl``).

    Examples:
        >>> [il for il in range(16) if use_more_bits(il, 16)]
        [0, 1, 4, 7, 10, 13, 14, 15]
    """
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or \
        (i_layer - n_layers // 8) % 3 == 2
# --8<-- [end:use_more_bits]


def layer_info(state: QuantizeState, counter: int, name: str) -> tuple[int, int]:
    """The layer of a FFN matrix: the counter, or, with experts, the number in ``blk.N.``.

    Raises:
        ModelQuantError: an expert model's tensor without a layer number in range.
    """
    n_layer = state.n_layer
    if max(1, state.n_expert) > 1:
        m = re.match(r"blk\.(-?\d+)\.", name)
        if m is None:
            raise ModelQuantError(f"Failed to determine layer for tensor {name}")
        counter = int(m.group(1))
        if not 0 <= counter < n_layer:
            raise ModelQuantError(
                f"Bad layer {counter} for tensor {name}. Must be in [0, {n_layer})")
    return counter, n_layer


# --8<-- [start:output_type]
def _output_type(state, new_type, ncols, params) -> GGMLQuantizationType:
    """``output.weight`` (and a tied ``token_embd.weight``): Q6_K unless the file is Q8_0,
    Q8_0 where K-quant blocks do not fit the row (or for Falcon)."""
    if params.output_tensor_type is not None:
        return params.output_tensor_type
    if state.arch == "falcon" or ncols % GGML_QUANT_SIZES[new_type][0] != 0:
        return T.Q8_0
    return new_type if new_type == T.Q8_0 else T.Q6_K
# --8<-- [end:output_type]


# --8<-- [start:attn_v_type]
def _attn_v_type(state: QuantizeState, new_type, ftype) -> GGMLQuantizationType:
    """The value projection (the sensitive one: with GQA, one V serves several heads)."""
    i, n = state.i_attention_wv, state.n_attention_wv
    if ftype == F.MOSTLY_Q2_K:
        new_type = T.Q4_K if state.n_gqa >= 4 else T.Q3_K
    elif ftype == F.MOSTLY_Q3_K_M:
        new_type = T.Q5_K if i < 2 else T.Q4_K
    elif ftype == F.MOSTLY_Q3_K_L:
        new_type = T.Q5_K
    elif ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(i, n):
        new_type = T.Q6_K
    elif ftype == F.MOSTLY_Q4_K_S and i < 4:
        new_type = T.Q5_K
    if state.is_70b and new_type in (T.Q3_K, T.Q4_K):  # 8 heads share each V: cheap to grow
        new_type = T.Q5_K
    if state.n_expert == 8:
        new_type = T.Q8_0
    state.i_attention_wv += 1
    return new_type
# --8<-- [end:attn_v_type]


# --8<-- [start:ffn_down_type]
def _ffn_down_type(state: QuantizeState, new_type, ftype, name) -> GGMLQuantizationType:
    """The FFN down projection, by layer: more bits in the layers of `use_more_bits`."""
    i_layer, n_layer = layer_info(state, state.i_ffn_down, name)
    falcon = state.arch == "falcon"
    if ftype == F.MOSTLY_Q2_K:
        new_type = T.Q3_K
    elif ftype == F.MOSTLY_Q3_K_M:
        new_type = (T.Q5_K if i_layer < n_layer // 16 else
                    T.Q4_K if not falcon or use_more_bits(i_layer, n_layer) else T.Q3_K)
    elif ftype == F.MOSTLY_Q3_K_L:
        new_type = T.Q4_K if falcon else T.Q5_K
    elif ftype == F.MOSTLY_Q4_K_M:
        if falcon:
            new_type = (T.Q6_K if i_layer < n_layer // 16 else
                        T.Q5_K if use_more_bits(i_layer, n_layer) else T.Q4_K)
        elif use_more_bits(i_layer, n_layer):
            new_type = T.Q6_K
    elif ftype == F.MOSTLY_Q5_K_M and use_more_bits(i_layer, n_layer):
        new_type = T.Q6_K
    elif ftype == F.MOSTLY_Q4_K_S and not falcon and i_layer < n_layer // 8:
        new_type = T.Q5_K
    state.i_ffn_down += 1
    return new_type
# --8<-- [end:ffn_down_type]


# --8<-- [start:attn_output_type]
def _attn_output_type(state: QuantizeState, new_type, ftype) -> GGMLQuantizationType:
    """The attention output projection: one step up in the low-bit K mixes."""
    if state.arch == "falcon":
        return T.Q4_K if ftype == F.MOSTLY_Q3_K_L else new_type
    if state.n_expert == 8:
        moe_q5 = (F.MOSTLY_Q2_K, F.MOSTLY_Q3_K_S, F.MOSTLY_Q3_K_M, F.MOSTLY_Q4_K_S,
                  F.MOSTLY_Q4_K_M)
        return T.Q5_K if ftype in moe_q5 else new_type
    return {F.MOSTLY_Q2_K: T.Q3_K, F.MOSTLY_Q3_K_M: T.Q4_K,
            F.MOSTLY_Q3_K_L: T.Q5_K}.get(ftype, new_type)
# --8<-- [end:attn_output_type]


# --8<-- [start:llama_tensor_get_type_impl]
def llama_tensor_get_type_impl(state: QuantizeState, new_type: GGMLQuantizationType,
                               name: str, ncols: int, ftype: LlamaFileType,
                               params: QuantizeParams = QuantizeParams()) -> GGMLQuantizationType:
    """The mix: the type of one quantizable tensor under ``ftype`` (its default ``new_type``).

    By category: the output matrix (and tied embeddings) -> Q6_K; the value projection, the
    FFN down projection and the attention output get more bits in some layers and mixes;
    everything else keeps the default. Advances the state's counters, so call it once per
    tensor, in [`tensor_order`][].
    """
    category = tensor_category(name)
    if category == "OUTPUT" or (state.has_tied_embeddings and category == "TOKEN_EMBD"):
        return _output_type(state, new_type, ncols, params)
    if category == "TOKEN_EMBD":  # only the I-quant and ternary mixes change it
        return new_type
    if category in ATTN_V_LIKE:
        return _attn_v_type(state, new_type, ftype)
    if category == "ATTENTION_K" and state.n_expert == 8:
        return T.Q8_0
    if category == "FFN_DOWN":
        return _ffn_down_type(state, new_type, ftype, name)
    if category == "ATTENTION_OUTPUT":
        return _attn_output_type(state, new_type, ftype)
    if category == "FFN_GATE":  # only the IQ3_XS mix changes them; the layer is still checked
        layer_info(state, state.i_ffn_gate, name)
        state.i_ffn_gate += 1
    if category == "FFN_UP":
        layer_info(state, state.i_ffn_up, name)
        state.i_ffn_up += 1
    return new_type
# --8<-- [end:llama_tensor_get_type_impl]


# --8<-- [start:tensor_type_fallback]
FALLBACK_TYPES = {  # a 256-block type -> a 32-block type of about the same size
    T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL,
    T.IQ2_S: T.IQ4_NL, T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL,
    T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.TQ1_0: T.Q4_0, T.TQ2_0: T.Q4_0,
    T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
}


def tensor_type_fallback(state: QuantizeState, name: str, ncols: int,
                         target: GGMLQuantizationType) -> GGMLQuantizationType:
    """A type whose blocks fit a row of ``ncols`` weights (``tensor_type_fallback``).

    ``target`` if its block size divides ``ncols``; else the 32-block type of
    `FALLBACK_TYPES` (a 32-block target stays), and F16 if even that does not fit.

    Examples:
        >>> s = QuantizeState("llama", n_layer=1, n_gqa=1)
        >>> [tensor_type_fallback(s, "w", n, T.Q4_K).name for n in (512, 288, 200)]
        ['Q4_K', 'Q5_0', 'F16']
    """
    block = GGML_QUANT_SIZES[target][0]
    if ncols % block == 0:
        return target
    state.n_fallback += 1
    if target in FALLBACK_TYPES:
        new_type = FALLBACK_TYPES[target]
    elif block <= 32:
        new_type = target
    else:
        raise ModelQuantError(f"no tensor type fallback is defined for type {target.name}")
    if ncols % GGML_QUANT_SIZES[new_type][0] != 0:
        new_type = T.F16  # "must use F16 due to unusual shape"
    state.fallbacks.append((name, ncols, target, new_type))
    return new_type
# --8<-- [end:tensor_type_fallback]


# --8<-- [start:llama_tensor_get_type]
def llama_tensor_get_type(state: QuantizeState, name: str, shape: tuple[int, ...],
                          current: GGMLQuantizationType, ftype: LlamaFileType,
                          params: QuantizeParams = QuantizeParams()) -> GGMLQuantizationType:
    """The type a tensor gets in the file (``llama_tensor_get_type``).

    A tensor that may not be quantized keeps ``current``; ``--token-embedding-type`` and
    ``--output-tensor-type`` are taken as given; under a quantized default type the mix
    decides (unless ``--pure``), then the fallback makes the blocks fit the row. F16, BF16
    and F32 files give every quantizable tensor their type, without mix or fallback.
    """
    if not tensor_allows_quantization(name, shape, params):
        return current
    category = tensor_category(name)
    if params.token_embedding_type is not None and category == "TOKEN_EMBD":
        return params.token_embedding_type
    if params.output_tensor_type is not None and category == "OUTPUT":
        return params.output_tensor_type
    new_type = llama_ftype_get_default_type(ftype)
    if new_type in (T.F32, T.F16, T.BF16):  # not ggml_is_quantized
        return new_type
    ncols = shape[-1]
    if not params.pure:
        new_type = llama_tensor_get_type_impl(state, new_type, name, ncols, ftype, params)
    return tensor_type_fallback(state, name, ncols, new_type)
# --8<-- [end:llama_tensor_get_type]


# ---------------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------------

# --8<-- [start:tensor_order]
def tensor_order(name: str) -> tuple[int, str]:
    """The order llama-quantize visits and writes tensors: by layer (``blk.N.``; other
    tensors first), then by name (``weight_name_comparer`` of ``llama_model_loader``).

    Examples:
        >>> sorted(["output.weight", "blk.10.attn_q.weight", "blk.2.attn_v.weight",
        ...         "blk.2.attn_k.weight"], key=tensor_order)   # doctest: +NORMALIZE_WHITESPACE
        ['output.weight', 'blk.2.attn_k.weight', 'blk.2.attn_v.weight',
         'blk.10.attn_q.weight']
    """
    m = re.match(r"blk\.([+-]?\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)
# --8<-- [end:tensor_order]


def _type_and_shape(tensor) -> tuple[GGMLQuantizationType, tuple[int, ...]]:
    if isinstance(tensor, QuantizedTensor):
        return GGMLQuantizationType(tensor.qtype), tuple(tensor.shape)
    if isinstance(tensor, np.ndarray) and tensor.dtype == np.float32:
        return T.F32, tuple(tensor.shape)
    raise ModelQuantError(
        f"a tensor must be a float32 array or a QuantizedTensor, got {type(tensor).__name__}"
        + (f" of {tensor.dtype}" if isinstance(tensor, np.ndarray) else ""))


# --8<-- [start:tensor_types]
def tensor_types(tensors: dict[str, Any], metadata: dict[str, Any],
                 ftype: str | int | LlamaFileType,
                 params: QuantizeParams = QuantizeParams()) -> dict[str, GGMLQuantizationType]:
    """The plan: every tensor's type in the file, in the order llama-quantize writes them.

    Args:
        tensors: name to a float32 array (F32) or a ``QuantizedTensor``; only the types and
            shapes are read.
        metadata: the file's metadata (``general.architecture``, ``{arch}.block_count``,
            the head counts).
        ftype: a file type of `FTYPES` (name, number or ``LlamaFileType``).
        params: the options.

    Returns:
        Tensor name to its ggml type, in [`tensor_order`][].

    Raises:
        ModelQuantError: an unsupported file type, missing hyperparameters, a tensor that is
            neither a float32 array nor a ``QuantizedTensor``.
    """
    ftype = parse_ftype(ftype)
    names = sorted(tensors, key=tensor_order)
    state = quantize_state(metadata, names)
    plan = {}
    for name in names:
        current, shape = _type_and_shape(tensors[name])
        plan[name] = llama_tensor_get_type(state, name, shape, current, ftype, params)
    return plan
# --8<-- [end:tensor_types]


def _check_plan(tensors, plan, params) -> None:
    """Refuse, before any work, what [`quantize_model`][] could not finish."""
    for name, new_type in plan.items():
        current, _ = _type_and_shape(tensors[name])
        if new_type == current:
            continue
        if new_type not in QUANTIZE:
            raise ModelQuantError(
                f"{name} needs type {new_type.name} (llama.cpp's choice, a fallback for its "
                f"row of {tensors[name].shape[-1]} weights), which this project cannot write "
                f"yet; supported: {', '.join(t.name for t in QUANTIZE)}")
        ncols = tensors[name].shape[-1]
        if ncols % GGML_QUANT_SIZES[new_type][0] != 0:  # only a type given by a flag can
            raise ModelQuantError(                      # miss the fallback
                f"{name}: a row of {ncols} weights is not a whole number of {new_type.name} "
                f"blocks ({GGML_QUANT_SIZES[new_type][0]} weights each)")
        if current not in (T.F32, T.F16, T.BF16) and not params.allow_requantize:
            raise ModelQuantError(
                f"requantizing from type {current.name} is disabled ({name}); "
                "allow it with allow_requantize (--allow-requantize)")


def convert_tensor(tensor, new_type: GGMLQuantizationType):
    """One tensor in its new type: dequantized to float32, then quantized (or copied when
    the type does not change). F32 comes back as a float32 array, the rest as a
    ``QuantizedTensor``."""
    current, shape = _type_and_shape(tensor)
    if current == new_type:
        return tensor
    x = tensor if current == T.F32 else dequantize(tensor.data, current).reshape(shape)
    if new_type == T.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    return QuantizedTensor(new_type, shape, quantize(x, new_type))


# --8<-- [start:quantize_model]
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def quantize_model(tensors: dict[str, Any], metadata: dict[str, Any],
                   ftype: str | int | LlamaFileType,
                   params: QuantizeParams = QuantizeParams()) -> tuple[dict, dict]:
    """A model in a file type: what ``llama_model_quantize`` writes, without an imatrix.

    Every tensor gets the type of [`tensor_types`][]: it is dequantized to float32 and
    quantized with ggml's reference quantizers, or copied when its type does not change.
    The metadata is copied, without the split keys, and ends with
    ``general.quantization_version = 2`` and ``general.file_type = ftype`` (both UINT32,
    removed first and appended, as ``gguf_set_val_u32`` does).

    Args:
        tensors: name to a float32 array or a ``QuantizedTensor`` (F16, BF16, ...).
        metadata: key to value, plain or [`GGUFValue`][reference.gguf.GGUFValue]
            (see [`typed_metadata`][] to keep a file's value types).
        ftype: a file type of `FTYPES`.
        params: the options.

    Returns:
        ``(tensors, metadata)`` for [`reference.gguf.write_gguf`][reference.gguf.write_gguf],
        tensors in llama.cpp's order.

    Raises:
        ModelQuantError: before any tensor is converted: an unsupported file type, a type
            the plan needs that cannot be written (Q5_0, the fallback of Q4_K), a type given
            in ``params`` whose blocks do not fit the tensor's rows, a quantized source
            without ``params.allow_requantize``.
        QuantError: a weight the quantizers refuse (not finite).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.arch import llama_metadata
        >>> hp = tiny_hparams("llama", n_embd=256, n_head=4, n_head_kv=4, n_ff=256)
        >>> out, md = quantize_model(random_weights(hp), llama_metadata(hp), "Q4_K_M")
        >>> out["blk.1.attn_v.weight"].qtype.name, out["blk.0.attn_q.weight"].qtype.name
        ('Q6_K', 'Q4_K')
        >>> md["general.file_type"].value, md["general.quantization_version"].value
        (15, 2)
    """
    ftype = parse_ftype(ftype)
    plan = tensor_types(tensors, metadata, ftype, params)
    _check_plan(tensors, plan, params)
    out = {name: convert_tensor(tensors[name], new_type) for name, new_type in plan.items()}
    md = {k: v for k, v in metadata.items()
          if k not in SPLIT_KEYS + ("general.quantization_version", "general.file_type")}
    md["general.quantization_version"] = GGUFValue(GGML_QNT_VERSION, GGUFValueType.UINT32)
    md["general.file_type"] = GGUFValue(int(ftype), GGUFValueType.UINT32)
    return out, md
# --8<-- [end:quantize_model]


def typed_metadata(gguf_file) -> dict[str, Any]:
    """A read file's metadata with every scalar wrapped in its stored type, so that writing
    it again keeps the types (a UINT8 stays a UINT8); arrays keep their item dtype."""
    return {k: v if gguf_file.value_types.get(k) in (None, GGUFValueType.ARRAY)
            else GGUFValue(v, gguf_file.value_types[k])
            for k, v in gguf_file.metadata.items()}
