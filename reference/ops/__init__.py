"""The operators, one small NumPy function per ggml op, named after it (without ``ggml_``).

The backward ops that training needs (``ggml_rope_ext_back``, ``ggml_soft_max_ext_back``,
``ggml_get_rows_back``, ``ggml_cross_entropy_loss`` and its backward) sit beside their
forwards; the backward rules that are compositions of ops are
[`reference.training.grad`][reference.training.grad]'s.

Every function is dtype-generic: it computes in the dtype of its inputs (float32 by default,
as llama.cpp's CPU backend; float64 when a property test wants rounding out of the way).
Shapes are written in NumPy order; ggml's ``ne`` is the reverse (see Conventions).
"""

from reference.ops.attention import build_attn_mha, soft_max_ext, soft_max_ext_back
from reference.ops.elementwise import add, mul, scale
from reference.ops.ffn import geglu, gelu, silu, swiglu
from reference.ops.loss import cross_entropy_loss, cross_entropy_loss_back
from reference.ops.matmul import mul_mat
from reference.ops.moe import argsort, argsort_top_k, mul_mat_id
from reference.ops.norm import norm, rms_norm
from reference.ops.rope import ROPE_TYPE_NEOX, ROPE_TYPE_NORM, rope_back, rope_ext
from reference.ops.rows import get_rows, get_rows_back, set_rows
from reference.ops.softcap import softcap, tanh
from reference.ops.ssm import ssm_conv, ssm_scan

__all__ = [
    "ROPE_TYPE_NEOX",
    "ROPE_TYPE_NORM",
    "add",
    "argsort",
    "argsort_top_k",
    "build_attn_mha",
    "cross_entropy_loss",
    "cross_entropy_loss_back",
    "geglu",
    "gelu",
    "get_rows",
    "get_rows_back",
    "mul",
    "mul_mat",
    "mul_mat_id",
    "norm",
    "rms_norm",
    "rope_back",
    "rope_ext",
    "scale",
    "set_rows",
    "silu",
    "soft_max_ext",
    "soft_max_ext_back",
    "softcap",
    "ssm_conv",
    "ssm_scan",
    "swiglu",
    "tanh",
]
