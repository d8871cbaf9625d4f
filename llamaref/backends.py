"""The backend choice: which twin's Context and sampler run a command.

``reference`` runs [`reference.context.Context`][reference.context.Context] on float32 weights
(quantized tensors are dequantized once at load, to the values the forward would compute each time);
``accelerated`` runs [`accelerated.context.Context`][accelerated.context.Context] on MLX (Q4_0,
Q4_1, Q8_0 stay quantized); ``auto`` picks ``accelerated`` when MLX's default device is a GPU (Metal
on a Mac, CUDA) and ``reference`` otherwise (MLX's CPU backend with its bundled reference BLAS is
slower than NumPy), whatever the architecture: the twin runs Mamba and Mamba-2 as well.

This is the one module of the application that chooses between the twins; the commands ask it
for a Context and a sampler and never name a twin themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from accelerated import sampling as accelerated_sampling
from accelerated.context import Context as AcceleratedContext
from accelerated.models.llama import default_matmul
from accelerated.models.llama import prepare_weights as accelerated_prepare_weights
from reference import sampling as reference_sampling
from reference.common import LlamarefError
from reference.context import Context

BACKENDS = ("auto", "accelerated", "reference")


class BackendError(LlamarefError):
    """A backend that does not exist, or cannot run this model here."""


# --8<-- [start:pick_backend]
def pick_backend(name: str, hparams: Any) -> str:
    """The backend that ``--backend name`` means on this machine.

    ``reference`` and ``accelerated`` are themselves. ``auto`` is ``accelerated`` when MLX's
    default device is a GPU (Metal, CUDA) and ``reference`` otherwise: on MLX's CPU device
    the twin is slower than NumPy. The rule is the same for every architecture: each twin
    runs every model the loader reads (llama, qwen2, gemma 1-3, mamba, mamba2), so
    ``hparams`` does not change the choice.

    Args:
        name: ``auto``, ``accelerated`` or ``reference``.
        hparams: the model's hyperparameters.

    Raises:
        BackendError: an unknown name.

    Examples:
        >>> from reference.testing import tiny_hparams, tiny_mamba_hparams
        >>> pick_backend("reference", tiny_hparams())
        'reference'
        >>> pick_backend("accelerated", tiny_mamba_hparams("mamba"))
        'accelerated'
        >>> pick_backend("auto", tiny_mamba_hparams("mamba2")) == pick_backend("auto",
        ...                                                                 tiny_hparams())
        True
        >>> pick_backend("gpu", tiny_hparams())
        Traceback (most recent call last):
        ...
        llamaref.backends.BackendError: unknown backend 'gpu'; choose one of auto, accelerated, reference
    """  # noqa: E501
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    return "accelerated" if mlx_has_gpu() else "reference"
# --8<-- [end:pick_backend]


def mlx_has_gpu() -> bool:
    """Whether MLX's default device is a GPU (Metal or CUDA)."""
    return mx.default_device().type == mx.DeviceType.gpu


# --8<-- [start:prepare_weights]
def prepare_weights(weights: dict, backend: str,
                    progress: Callable[[int, int], None] | None = None,
                    bounded: bool | None = None) -> dict:
    """The weights as ``backend``'s Context wants them, converted once, tensor by tensor.

    ``reference``: every tensor a float32 array (quantized ones dequantized, the values the
    forward computes with); ``accelerated``:
    [`accelerated.models.llama.prepare_weights`][accelerated.models.llama.prepare_weights] (the
    types MLX holds exactly stay packed).

    Args:
        weights: GGUF-named weights from
            [`reference.model_loader.load_model`][reference.model_loader.load_model].
        backend: ``"reference"`` or ``"accelerated"``.
        progress: called with ``(tensors done, tensors in all)`` after each tensor.
        bounded: keep Q6_K and Q2_K packed too, within their stated bound (``accelerated``
            only). None: where the Context will run quantized matmuls
            ([`accelerated.models.llama.default_matmul`][accelerated.models.llama.default_matmul]
            is ``"quantized"``: a GPU), so that a ``Q4_K_M`` file stays packed there; on the
            CPU the weights are dense, and exact.

    Examples:
        >>> w = prepare_weights({"a": np.ones(2, np.float16)}, "reference")
        >>> w["a"].dtype
        dtype('float32')
    """
    if backend == "accelerated":
        keep = default_matmul() == "quantized" if bounded is None else bounded

        def prepare_one(w):
            return accelerated_prepare_weights(w, bounded=keep)
    else:
        def prepare_one(w):
            return {name: _dense(t) for name, t in w.items()}
    out = {}
    for i, (name, t) in enumerate(weights.items()):
        out.update(prepare_one({name: t}))
        if progress is not None:
            progress(i + 1, len(weights))
    return out
# --8<-- [end:prepare_weights]


def _dense(t) -> np.ndarray:
    if hasattr(t, "dequantize"):
        return t.dequantize().astype(np.float32, copy=False)
    t = np.asarray(t)
    return t.astype(np.float32) if np.issubdtype(t.dtype, np.floating) else t


def make_context(backend: str, hparams, weights: dict, **kwargs) -> Context:
    """A Context of ``backend`` (``reference`` or ``accelerated``) on prepared weights."""
    if backend == "accelerated":
        return AcceleratedContext(hparams, weights, **kwargs)
    return Context(hparams, weights, **kwargs)


def make_sampler(
    backend: str, params: Any, n_vocab: int, tokenizer: Any = None
) -> tuple[Any, bool]:
    """``SamplerChain.from_params`` of ``backend``'s sampling module.

    Returns:
        ``(sampler, on_device)``: ``on_device`` is True when the sampler is the MLX twin,
        which takes the logits as an ``mx.array`` without a copy to the host.
    """
    if backend == "accelerated":
        chain = accelerated_sampling.SamplerChain
        return chain.from_params(params, n_vocab, tokenizer=tokenizer), True
    chain = reference_sampling.SamplerChain
    return chain.from_params(params, n_vocab, tokenizer=tokenizer), False


