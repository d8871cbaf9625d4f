"""The exceptions of the training specification.

ggml-opt and llama.cpp check training arguments with ``GGML_ASSERT`` (the process aborts);
the specification raises a typed exception instead, before any weight, momentum or counter
changes. Shape errors of the backward operators are the operators' own
[`reference.ops.errors.OpShapeError`][reference.ops.errors.OpShapeError].
"""

from __future__ import annotations

from reference.common import LlamarefError


# --8<-- [start:errors]
class TrainingError(LlamarefError):
    """Base class of every error raised by ``reference.training``."""


class OptParamsError(TrainingError, ValueError):
    """Optimizer hyperparameters outside ggml-opt's domain (``ggml_opt_eval``'s asserts)."""


class DatasetError(TrainingError, ValueError):
    """A dataset cannot be cut from the tokens, or a train/validation split is out of range."""


class ScheduleError(TrainingError, ValueError):
    """Learning-rate schedule arguments that ``lr_opt`` cannot use (e.g. no epochs)."""


class TrainGraphError(TrainingError, ValueError):
    """A model or batch the training graph does not support (ggml has no backward for it)."""


# --8<-- [end:errors]
