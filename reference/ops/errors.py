"""The exceptions the operators raise.

ggml checks an operator's arguments with ``GGML_ASSERT`` when the graph is built (shapes) or
when it runs (row indices), and aborts the process. The specification raises a typed
exception instead, with a message that says which argument was wrong, before anything is
computed or written. Every exception derives from [`OpError`][], and from the built-in
exception a Python reader expects (``ValueError`` for shapes, ``IndexError`` for indices,
``TypeError`` for dtypes), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

from reference.common import LlamarefError


# --8<-- [start:errors]
class OpError(LlamarefError):
    """Base class of every error raised by ``reference.ops``."""


class OpShapeError(OpError, ValueError):
    """The shapes of an operator's arguments do not fit together (ggml would assert)."""


class OpIndexError(OpError, IndexError):
    """A row index is outside the tensor it indexes (``GGML_ASSERT(i01 >= 0 && i01 < ne01)``)."""


class OpTypeError(OpError, TypeError):
    """An argument has a dtype the operator does not accept (e.g. float row indices)."""


class OpValueError(OpError, ValueError):
    """A scalar parameter of an operator is out of its domain (e.g. a soft-cap of 0)."""


# --8<-- [end:errors]
