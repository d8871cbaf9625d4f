"""The operators, one small NumPy function per ggml op, named after it (without ``ggml_``).

Every function is dtype-generic: it computes in the dtype of its inputs (float32 by default,
as llama.cpp's CPU backend; float64 when a property test wants rounding out of the way).
Shapes are written in NumPy order; ggml's ``ne`` is the reverse (see Conventions).
"""

from reference.ops.attention import build_attn_mha, soft_max_ext
from reference.ops.elementwise import add, mul, scale
from reference.ops.ffn import geglu, gelu, silu, swiglu
from reference.ops.matmul import mul_mat
from reference.ops.norm import norm, rms_norm
from reference.ops.rope import ROPE_TYPE_NEOX, ROPE_TYPE_NORM, rope_ext
from reference.ops.rows import get_rows, set_rows
from reference.ops.softcap import softcap, tanh
from reference.ops.ssm import ssm_conv, ssm_scan

__all__ = [
    "ROPE_TYPE_NEOX",
    "ROPE_TYPE_NORM",
    "add",
    "build_attn_mha",
    "geglu",
    "gelu",
    "get_rows",
    "mul",
    "mul_mat",
    "norm",
    "rms_norm",
    "rope_ext",
    "scale",
    "set_rows",
    "silu",
    "soft_max_ext",
    "softcap",
    "ssm_conv",
    "ssm_scan",
    "swiglu",
    "tanh",
]
