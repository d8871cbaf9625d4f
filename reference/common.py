r"""The names every layer shares: llama.cpp's limits, the default seed, dtypes, thresholds, errors.

One home for the vocabulary that more than one module speaks, so that no module defines its
own copy (and no two copies drift):

- **limits** of llama.cpp: ``LLAMA_MAX_SEQ`` (``src/llama-cparams.h``: the most sequences a
  context holds, and the width of a KV cell's sequence bitset) and ``POS_INF``
  (``std::numeric_limits<llama_pos>::max()``: what ``p1 < 0`` means in ``seq_rm`` and
  friends);
- ``LLAMA_DEFAULT_SEED`` (``llama.h``): the seed that means "draw a random one";
- the **dtypes** a cache, a state row or a state blob holds, with their ggml type ids;
- the **twin thresholds**: how close the MLX twin must come to the reference, in
  test-backend-ops' NMSE ([`reference.testing.nmse`][reference.testing.nmse]);
- [`LlamarefError`][], the base class of every typed error the project raises. Each error
  also derives from the built-in class that says what kind of mistake it is (``ValueError``
  for a bad value, ``IndexError`` for an index out of range), so ``except ValueError`` keeps
  working.
"""

from __future__ import annotations

import numpy as np

# --8<-- [start:limits]
LLAMA_MAX_SEQ = 256  # src/llama-cparams.h: the most sequences a context can hold
POS_INF = 2**31 - 1  # std::numeric_limits<llama_pos>::max(): "to the end" in seq_* ranges
LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.h: a random seed is drawn
# --8<-- [end:limits]

# --8<-- [start:dtypes]
# ggml type ids (ggml.h) of the dtypes a cache or a state row may hold
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_F64 = 28
GGML_TYPE_OF_DTYPE = {
    np.dtype(np.float32): GGML_TYPE_F32,
    np.dtype(np.float16): GGML_TYPE_F16,
    np.dtype(np.float64): GGML_TYPE_F64,
}
DTYPE_OF_GGML_TYPE = {t: d for d, t in GGML_TYPE_OF_DTYPE.items()}
# --8<-- [end:dtypes]

# --8<-- [start:thresholds]
#: an operator twin's largest NMSE against the reference (test-backend-ops' defaults)
MAX_NMSE_OP = {"default": 1e-7, "soft_max_ext": 1e-6, "mul_mat": 5e-4, "attention": 5e-4}
#: a whole forward (or decode) of the twin against the reference: float32 end to end
MAX_NMSE_TWIN = 1e-6
#: two float32 decodes of the same cells in another order (batched vs unbatched, shifted vs
#: fresh): the reference's float32 bound, which the twin meets against itself too
MAX_NMSE_SELF_F32 = 1e-10
# --8<-- [end:thresholds]


# --8<-- [start:LlamarefError]
class LlamarefError(Exception):
    """The base class of llamaref's typed errors.

    Every error is raised *before* any state changes, with a message that says what was wrong.

    Examples:
        >>> from reference.batch import BatchError
        >>> issubclass(BatchError, LlamarefError), issubclass(BatchError, ValueError)
        (True, True)
    """
# --8<-- [end:LlamarefError]


class QuantError(LlamarefError, ValueError):
    """A block format cannot be read or written: unsupported type, sizes that do not fit, or
    weights a quantizer refuses (here so that every quant module can raise it)."""
