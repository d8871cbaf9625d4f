r"""Hyperparameters of a model, with llama.cpp's ``llama_hparams`` field names.

llama.cpp reads these from GGUF metadata keys of the form ``{arch}.{key}`` (for example
``llama.attention.head_count``) in ``llama_model::load_hparams``: the key table and its reader
and writer are [`reference.arch`][reference.arch]; a HF ``config.json`` is mapped onto the same
fields once, at load time ([`reference.hf`][reference.hf]). Everything downstream (the model,
the memory, the context) reads only these dataclasses.

Derived sizes follow ``llama-hparams.h``:

$$
n_{gqa} = n_{head} / n_{head\_kv}, \qquad
n_{embd\_k\_gqa} = n_{embd\_head\_k} \cdot n_{head\_kv}.
$$

[`LlamaHParams`][] describes the ``llama``, ``qwen2``, ``qwen3``, ``qwen3moe``, ``gemma``,
``gemma2`` and ``gemma3`` architectures (``LLAMA_ARCHS``), checked by [`hparams_errors`][];
a mixture of experts (Mixtral as ``llama``, ``qwen3moe``) has ``n_expert > 0`` and its
experts' width is [`n_ff_expert`][LlamaHParams.n_ff_expert]; beside it are what llama.cpp
derives from it: the sliding window ([`is_masked_swa`][], [`swa_pattern`][]), the RoPE
parameters of a context ([`rope_cparams`][]) and Gemma 2/3's query scale, which no key holds
([`gemma_attention_scale`][]). The selective state space models (``mamba``, ``mamba2``) have
their own dataclass, [`MambaHParams`][] (the ``ssm_*`` fields, ``n_embd_r()``/``n_embd_s()``),
checked by [`mamba_hparams_errors`][].

Like llama.cpp, floats are held as float32; a GGUF key may hold one value per layer, but these
dataclasses hold one value, so per-layer arrays must be uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference.common import LlamarefError
from reference.ops.rope import ROPE_TYPE_NEOX, ROPE_TYPE_NORM, RopeParams  # noqa: F401  (re-exported)

# The GGUF architectures each dataclass describes (general.architecture).
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")  # reference.models.gemma's graphs
QWEN3_ARCHS = ("qwen3", "qwen3moe")  # per-head RMS norms of Q and K (attn_q_norm, attn_k_norm)
MOE_ARCHS = ("llama", "qwen3moe")  # the architectures whose FFN may be a mixture of experts
LLAMA_ARCHS = ("llama", "qwen2", *QWEN3_ARCHS, *GEMMA_ARCHS)  # what LlamaHParams describes
#: ``LLAMA_MAX_EXPERTS`` (``src/llama-hparams.h``): the most experts llama.cpp loads
LLAMA_MAX_EXPERTS = 1024

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
        swa_type: one of ``SWA_TYPE_*`` from [`reference.hparams`][reference.hparams].
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
    if hp.swa_layers and len(hp.swa_layers) != hp.n_layer:
        errors.append(f"swa_layers has {len(hp.swa_layers)} entries, expected n_layer="
                      f"{hp.n_layer} (or none: every layer is SWA)")
    if hp.f_attn_logit_softcapping < 0 or hp.f_final_logit_softcapping < 0:
        errors.append("soft-capping values must be >= 0 (0: no soft-capping)")
    errors += expert_errors(hp)
    if hp.arch in QWEN3_ARCHS and not hp.n_embd_head_k == hp.n_embd_head_v == hp.n_rot:
        errors.append(f"{hp.arch}: n_embd_head_k={hp.n_embd_head_k}, n_embd_head_v="
                      f"{hp.n_embd_head_v} and n_rot={hp.n_rot} must be equal (llama.cpp's "
                      "graph asserts it)")
    if hp.arch in GEMMA_ARCHS and hp.n_embd_head_k != hp.n_embd_head_v:
        errors.append(f"{hp.arch}: n_embd_head_k={hp.n_embd_head_k} must equal n_embd_head_v="
                      f"{hp.n_embd_head_v} (llama.cpp's Gemma graphs split Q, K, V heads with "
                      "one size)")
    return errors
# --8<-- [end:hparams_errors]


# --8<-- [start:expert_errors]
def expert_errors(hp: LlamaHParams) -> list[str]:
    """What is inconsistent in the experts of ``hp`` (``llama_model_base::load_hparams``'
    asserts and ``qwen3moe``'s loader).

    ``n_expert = 0`` is a dense FFN: no expert is used. Otherwise ``1 <= n_expert_used <=
    n_expert <= LLAMA_MAX_EXPERTS``, on an architecture with experts (``MOE_ARCHS``);
    ``qwen3moe`` must have them. ``n_ff_exp`` (``expert_feed_forward_length``) is
    ``qwen3moe``'s: Mixtral's experts are ``n_ff`` wide.

    Examples:
        >>> hp = LlamaHParams(arch="qwen3moe", n_vocab=8, n_ctx_train=16, n_embd=8,
        ...     n_layer=1, n_head=2, n_head_kv=2, n_embd_head_k=4, n_embd_head_v=4, n_rot=4,
        ...     n_ff=8, f_norm_rms_eps=1e-5, n_expert=4, n_expert_used=2, n_ff_exp=6)
        >>> expert_errors(hp), hp.n_ff_expert()
        ([], 6)
        >>> import dataclasses
        >>> dataclasses.replace(hp, n_expert_used=5)
        Traceback (most recent call last):
        ...
        reference.hparams.HParamsError: n_expert_used=5 must be in [1, n_expert=4]
    """
    if hp.n_expert < 0 or hp.n_expert_used < 0 or hp.n_ff_exp < 0:
        return ["n_expert, n_expert_used and n_ff_exp must be >= 0"]
    if hp.n_expert == 0:
        if hp.arch == "qwen3moe":
            return ["qwen3moe: n_expert must be > 0 (llama.cpp: 'n_expert must be > 0 for "
                    "QWEN3MOE')"]
        if hp.n_expert_used or hp.n_ff_exp:
            return [f"n_expert_used={hp.n_expert_used} and n_ff_exp={hp.n_ff_exp} need "
                    "experts (n_expert > 0)"]
        return []
    errors = []
    if hp.arch not in MOE_ARCHS:
        errors.append(f"{hp.arch}: no mixture of experts (n_expert={hp.n_expert}); "
                      f"architectures with experts: {MOE_ARCHS}")
    if hp.n_expert > LLAMA_MAX_EXPERTS:
        errors.append(f"n_expert={hp.n_expert} exceeds LLAMA_MAX_EXPERTS={LLAMA_MAX_EXPERTS}")
    if not 1 <= hp.n_expert_used <= hp.n_expert:
        errors.append(f"n_expert_used={hp.n_expert_used} must be in [1, n_expert="
                      f"{hp.n_expert}]")
    if hp.n_ff_exp and hp.arch != "qwen3moe":
        errors.append(f"{hp.arch}: n_ff_exp is qwen3moe's (the experts are n_ff wide)")
    return errors
# --8<-- [end:expert_errors]


@dataclass(frozen=True)
class LlamaHParams:
    r"""The hyperparameters the Llama-family forward pass needs (``llama_hparams``).

    Attributes:
        arch: GGUF ``general.architecture`` (one of ``LLAMA_ARCHS``: ``"llama"``,
            ``"qwen2"``, ``"qwen3"``, ``"qwen3moe"``, ``"gemma"``, ``"gemma2"``, ``"gemma3"``).
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
        rope_type: ``ROPE_TYPE_NORM`` (llama) or ``ROPE_TYPE_NEOX`` (qwen*, gemma*); fixed by
            arch.
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
        swa_layers: which layers use the sliding window (``llama_hparams::swa_layers``), one
            bool per layer; empty means every layer when ``swa_type`` is set (llama.cpp's
            ``n_pattern = 0``). Read through [`is_swa`][].
        rope_freq_base_train_swa: RoPE base of the SWA layers (Gemma 3's local 10 000);
            0 means ``rope_freq_base_train``.
        rope_freq_scale_train_swa: RoPE frequency scale of the SWA layers; 0 means
            ``rope_freq_scale_train``.
        f_attn_logit_softcapping: Gemma 2's attention soft-cap $c$
            ($s \mapsto c \tanh(s / c)$ on the scaled scores); 0: none.
        f_final_logit_softcapping: Gemma 2's soft-cap of the logits; 0: none.
        n_expert: experts of each FFN (``expert_count``); 0: a dense FFN.
        n_expert_used: experts per token (``expert_used_count``), the $k$ of the top-k.
        n_ff_exp: width of one expert (``expert_feed_forward_length``, ``qwen3moe`` only);
            0: the default of [`n_ff_expert`][].
        expert_weights_norm: scale the chosen experts' weights to sum to 1 (``build_moe_ffn``'s
            ``norm_w``). llama.cpp's ``llama`` and ``qwen3moe`` graphs pass true: False
            describes a HF Qwen3-MoE with ``norm_topk_prob = false``, which no GGUF of these
            architectures can state.
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
    swa_layers: tuple[bool, ...] = ()
    rope_freq_base_train_swa: float = 0.0
    rope_freq_scale_train_swa: float = 0.0
    f_attn_logit_softcapping: float = 0.0
    f_final_logit_softcapping: float = 0.0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "swa_layers", tuple(bool(b) for b in self.swa_layers))
        for error in hparams_errors(self):
            raise HParamsError(error)

    # --8<-- [start:is_swa]
    def is_swa(self, il: int) -> bool:
        """Whether layer ``il`` attends through the sliding window (``llama_hparams::is_swa``).

        Examples:
            >>> hp = LlamaHParams(arch="llama", n_vocab=8, n_ctx_train=16, n_embd=8, n_layer=3,
            ...     n_head=2, n_head_kv=2, n_embd_head_k=4, n_embd_head_v=4, n_rot=4, n_ff=8,
            ...     f_norm_rms_eps=1e-5, n_swa=4, swa_type=SWA_TYPE_STANDARD,
            ...     swa_layers=swa_pattern(3, 2))
            >>> [hp.is_swa(il) for il in range(3)], hp.is_swa_any(), hp.is_swa_all()
            ([True, False, True], True, False)
        """
        if self.swa_type == SWA_TYPE_NONE:
            return False
        return not self.swa_layers or self.swa_layers[il]

    def is_swa_any(self) -> bool:
        """Some layer uses the sliding window."""
        return any(self.is_swa(il) for il in range(self.n_layer))

    def is_swa_all(self) -> bool:
        """Every layer uses the sliding window (a single cache serves them all)."""
        return all(self.is_swa(il) for il in range(self.n_layer))
    # --8<-- [end:is_swa]

    # --8<-- [start:n_ff_expert]
    def n_ff_expert(self) -> int:
        """Width of one expert's FFN: ``qwen3moe``'s ``n_ff_exp``, else ``n_ff / n_expert_used``
        (its loader's default); Mixtral's (``llama``) experts are ``n_ff`` wide.

        Examples:
            >>> hp = LlamaHParams(arch="llama", n_vocab=8, n_ctx_train=16, n_embd=8,
            ...     n_layer=1, n_head=2, n_head_kv=2, n_embd_head_k=4, n_embd_head_v=4,
            ...     n_rot=4, n_ff=12, f_norm_rms_eps=1e-5, n_expert=4, n_expert_used=2)
            >>> hp.n_ff_expert()
            12
        """
        if self.arch == "qwen3moe":
            return self.n_ff_exp or self.n_ff // self.n_expert_used
        return self.n_ff
    # --8<-- [end:n_ff_expert]

    def n_gqa(self) -> int:
        """Query heads per key/value head."""
        return self.n_head // self.n_head_kv

    def n_embd_k_gqa(self) -> int:
        """Width of all key heads of one token: ``n_embd_head_k * n_head_kv``."""
        return self.n_embd_head_k * self.n_head_kv

    def n_embd_v_gqa(self) -> int:
        """Width of all value heads of one token: ``n_embd_head_v * n_head_kv``."""
        return self.n_embd_head_v * self.n_head_kv


# --8<-- [start:swa_pattern]
def swa_pattern(n_layer: int, n_pattern: int, dense_first: bool = False) -> tuple[bool, ...]:
    """Which layers are SWA for a repeating pattern (``llama_hparams::set_swa_pattern``).

    With ``n_pattern = n`` every ``n``-th layer is dense: the last of each group of ``n``
    (``il % n < n - 1`` is SWA), or the first with ``dense_first`` (``il % n != 0``).
    ``n = 0`` makes every layer SWA; ``n = 1`` none. Gemma 2 uses 2 (1:1), Gemma 3 uses 6
    (5:1).

    Examples:
        >>> swa_pattern(6, 6)
        (True, True, True, True, True, False)
        >>> swa_pattern(4, 2), swa_pattern(4, 2, dense_first=True), swa_pattern(2, 0)
        ((True, False, True, False), (False, True, False, True), (True, True))
    """
    if n_pattern == 0:
        return (True,) * n_layer
    if dense_first:
        return tuple(il % n_pattern != 0 for il in range(n_layer))
    return tuple(il % n_pattern < n_pattern - 1 for il in range(n_layer))
# --8<-- [end:swa_pattern]


# --8<-- [start:rope_cparams]
def rope_cparams(hparams: LlamaHParams, il: int | None = None) -> RopeParams:
    r"""The [`RopeParams`][reference.ops.rope.RopeParams] of this model, as ``llama_context``
    derives them.

    Mirrors the constructor of ``llama_context`` (``cparams``): no scaling type means
    ``freq_scale = 1``; a negative ``yarn_ext_factor`` means 1 for YaRN and 0 otherwise;
    with YaRN the attention factor is reset so that ``rope_ext``'s own
    $1 + 0.1 \ln(1/s)$ magnitude correction is the only one applied; ``n_ctx_orig`` is
    ``n_ctx_orig_yarn``, or ``n_ctx_train`` when that is 0.

    For layer ``il`` of a model with sliding-window layers, a SWA layer takes
    ``rope_freq_base_train_swa`` / ``rope_freq_scale_train_swa`` where they are set
    (``llm_graph_context``: ``freq_base_l = hparams.is_swa(il) ? rope_freq_base_train_swa :
    freq_base``); ``il = None`` gives the non-SWA values.

    Examples:
        >>> hp = LlamaHParams(arch="llama", n_vocab=8, n_ctx_train=64, n_embd=8, n_layer=1,
        ...     n_head=2, n_head_kv=1, n_embd_head_k=4, n_embd_head_v=4, n_rot=4, n_ff=16,
        ...     f_norm_rms_eps=1e-5, rope_freq_scale_train=0.5)
        >>> p = rope_cparams(hp)
        >>> p.freq_scale, p.ext_factor, p.n_ctx_orig, p.n_dims
        (1.0, 0.0, 64, 4)
    """
    scaling = hparams.rope_scaling_type_train
    freq_scale = 1.0 if scaling == ROPE_SCALING_TYPE_NONE else hparams.rope_freq_scale_train
    freq_base = hparams.rope_freq_base_train
    if il is not None and hparams.is_swa(il):
        freq_base = hparams.rope_freq_base_train_swa or freq_base
        freq_scale = hparams.rope_freq_scale_train_swa or freq_scale
    ext_factor = hparams.yarn_ext_factor
    if ext_factor < 0.0:  # negative means "not set"
        ext_factor = 1.0 if scaling == ROPE_SCALING_TYPE_YARN else 0.0
    attn_factor = hparams.yarn_attn_factor
    if ext_factor != 0.0:
        # get_mscale(factor, 1) / (1 + 0.1 ln factor) == 1: rope_ext applies the correction
        attn_factor = 1.0
    return RopeParams(
        n_dims=hparams.n_rot,
        mode=hparams.rope_type,
        n_ctx_orig=hparams.n_ctx_orig_yarn or hparams.n_ctx_train,
        freq_base=freq_base,
        freq_scale=freq_scale,
        ext_factor=ext_factor,
        attn_factor=attn_factor,
        beta_fast=hparams.yarn_beta_fast,
        beta_slow=hparams.yarn_beta_slow,
    )
# --8<-- [end:rope_cparams]


# --8<-- [start:gemma_attention_scale]
def gemma_attention_scale(arch: str, n_layer: int, n_embd: int, n_head: int,
                          n_embd_head_k: int) -> float:
    r"""The query scale llama.cpp gives Gemma 2 / Gemma 3: a GGUF has no key for it.

    ``load_arch_hparams`` of ``src/models/gemma2.cpp`` / ``gemma3.cpp`` derive
    ``f_attention_scale`` from the model type, which is the layer count: the 27B models
    (Gemma 2: 46 layers, Gemma 3: 62) scale by $1/\sqrt{n_{embd} / n_{head}}$ (integer
    division), every other by $1/\sqrt{n_{embd\_head\_k}}$; computed in float32
    (``1.0f / std::sqrt(float(...))``). HF's ``query_pre_attn_scalar`` $s$ scales by
    $s^{-1/2}$: a HF config whose $s$ gives another value cannot be written as a GGUF
    (see [`llama_metadata`][reference.arch.llama_metadata]).

    Examples:
        >>> gemma_attention_scale("gemma2", 26, 2304, 8, 256)
        0.0625
        >>> round(gemma_attention_scale("gemma2", 46, 4608, 32, 128), 6)  # 27B: 1/sqrt(144)
        0.083333
    """
    type_27b = {"gemma2": 46, "gemma3": 62}.get(arch)
    d = n_embd // n_head if n_layer == type_27b else n_embd_head_k
    return float(np.float32(1.0) / np.sqrt(np.float32(d)))
# --8<-- [end:gemma_attention_scale]


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

    The memory sizes its rows with [`n_embd_r`][] and [`n_embd_s`][], as
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
