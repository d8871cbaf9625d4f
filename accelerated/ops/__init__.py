"""Twin of [`reference.ops`][reference.ops]: the operators on MLX, one function per ggml op, same
names.

Every function takes ``mx.array`` (NumPy input is converted with ``mx.array()``; float64
becomes float32, MLX's default) and returns a lazy ``mx.array``. Shapes are in NumPy order,
as in the reference. Errors are the reference's exception classes.
"""

from accelerated.ops.attention import build_attn_mha, soft_max_ext, soft_max_ext_back
from accelerated.ops.elementwise import add, mul, scale
from accelerated.ops.ffn import geglu, gelu, silu, swiglu
from accelerated.ops.loss import cross_entropy_loss, cross_entropy_loss_back
from accelerated.ops.matmul import mul_mat
from accelerated.ops.moe import argsort, argsort_top_k, mul_mat_id
from accelerated.ops.norm import norm, rms_norm
from accelerated.ops.rope import ROPE_TYPE_NEOX, ROPE_TYPE_NORM, rope_back, rope_ext
from accelerated.ops.rows import get_rows, get_rows_back, set_rows
from accelerated.ops.softcap import softcap, tanh
from accelerated.ops.ssm import ssm_conv, ssm_scan

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
