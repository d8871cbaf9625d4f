"""Twin of [`reference.ops`][reference.ops]: the operators on MLX, one function per ggml op, same
names.

Every function takes ``mx.array`` (NumPy input is converted with ``mx.array()``; float64
becomes float32, MLX's default) and returns a lazy ``mx.array``. Shapes are in NumPy order,
as in the reference. Errors are the reference's exception classes.
"""

from accelerated.ops.attention import build_attn_mha, soft_max_ext
from accelerated.ops.elementwise import add, mul, scale
from accelerated.ops.ffn import geglu, gelu, silu, swiglu
from accelerated.ops.matmul import mul_mat
from accelerated.ops.norm import norm, rms_norm
from accelerated.ops.rope import ROPE_TYPE_NEOX, ROPE_TYPE_NORM, rope_ext
from accelerated.ops.rows import get_rows, set_rows
from accelerated.ops.softcap import softcap, tanh
from accelerated.ops.ssm import ssm_conv, ssm_scan

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
