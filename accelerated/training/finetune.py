"""Twin of [`reference.training.finetune`][reference.training.finetune]: the MLX
[`TRAINER`][accelerated.training.finetune.TRAINER].

The driver, its checks and its reports are the reference's, imported; what the twin supplies
is the [`reference.training.finetune.Trainer`][reference.training.finetune.Trainer] that puts the
weights on MLX (float32 ``mx.array``) and runs
[`accelerated.training.epoch.opt_epoch`][accelerated.training.epoch.opt_epoch] with
[`accelerated.training.opt.OptContext`][accelerated.training.opt.OptContext].

LoRA: the gradients of the adapted weights come from MLX, the adapter's step is the
reference's [`reference.training.lora.LoraOptContext`][reference.training.lora.LoraOptContext]
on the host (the adapted weights are copied back to MLX after each step); an MLX twin of the
LoRA step is not written yet.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from accelerated.training.epoch import opt_epoch
from accelerated.training.opt import OptContext
from reference.training.finetune import (  # the driver, imported as it is
    TRAINABLE_ARCHS,
    EpochReport,
    FinetuneError,
    FinetuneParams,
    FinetuneResult,
    LoraParams,
    Trainer,
    check_finetune,
    finetune,
    finetune_batch_sizes,
    header_line,
)
from reference.training.lora import LoraAdapter, LoraOptContext

__all__ = [
    "TRAINABLE_ARCHS",
    "TRAINER",
    "EpochReport",
    "FinetuneError",
    "FinetuneParams",
    "FinetuneResult",
    "LoraParams",
    "Trainer",
    "check_finetune",
    "finetune",
    "finetune_batch_sizes",
    "header_line",
]


def _to_device(weights: dict) -> dict:
    """Float tensors as float32 ``mx.array`` (evaluated now), integer ones as they are."""
    out = {}
    for name, w in weights.items():
        a = np.asarray(w)
        out[name] = mx.array(a.astype(np.float32)) if np.issubdtype(a.dtype, np.floating) else (
            mx.array(a))
    mx.eval(list(out.values()))
    return out


def _to_host(weights: dict) -> dict:
    """Every tensor as a NumPy array."""
    return {name: np.array(w) for name, w in weights.items()}


class _HostLoraOptContext:
    """The reference's LoRA step behind the MLX epoch: MLX gradients of the adapted
    weights in, the new adapted weights (MLX) out."""

    def __init__(self, weights: dict, adapter: LoraAdapter, optimizer: str = "adamw",
                 opt_period: int = 1, get_opt_pars=None):
        self.inner = LoraOptContext(weights, adapter, optimizer, opt_period, get_opt_pars)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # iter, opt_period, params, grad_accs, m, v

    def eval_backward(self, weights: dict, grads: dict) -> bool:
        targets = self.inner.adapter.targets
        host_grads = {name: np.array(grads[name]) for name in targets if name in grads}
        adapted: dict = {}
        stepped = self.inner.eval_backward(adapted, host_grads)
        for name, w in adapted.items():
            weights[name] = mx.array(w.astype(np.float32))
        mx.eval([weights[n] for n in adapted])
        return stepped


TRAINER = Trainer("accelerated", _to_device, _to_host, OptContext, opt_epoch,
                  _HostLoraOptContext)
"""The MLX [`Trainer`][reference.training.finetune.Trainer]: ``mx.value_and_grad`` and ggml's
optimizer formulas as MLX ops."""
