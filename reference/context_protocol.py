r"""What a program asks of a context: ``llama.h``'s context API, declared once.

The programs of [`reference.tools`][reference.tools] (generate, batched, batched-bench,
parallel, speculative, passkey, perplexity, the server's scheduler) and the application's
bench are written against a context, not against a class. Three classes answer them:

| context | what it is | ``on_device`` |
|---|---|---|
| [`reference.context.Context`][reference.context.Context] | the specification, NumPy | False |
| [`accelerated.context.Context`][accelerated.context.Context] | its MLX twin | True |
| ``llamaref.llamacpp.LlamaCppContext`` | llama.cpp itself (the application's peer) | False |

[`ContextLike`][] names what the programs read, with llama.cpp's names (``llama.h``), and
[`MemoryLike`][] what they ask of ``ctx.memory`` (``llama_memory_*``). A program reads these
as plain attributes: a capability a context may lack is declared as a flag (``recurrent``,
``on_device``), never probed with ``getattr`` or ``hasattr``.

| ours | llama.cpp (``llama.h``) |
|---|---|
| ``hparams`` | ``llama_model``'s hyperparameters (``llama_hparams``) |
| ``memory`` | ``llama_get_memory(ctx)`` |
| ``n_ctx``, ``n_ctx_seq``, ``n_batch``, ``n_ubatch``, ``n_seq_max`` | ``llama_n_ctx``, ... |
| ``n_vocab`` | ``llama_vocab_n_tokens`` |
| ``recurrent`` | ``llama_model_is_recurrent`` |
| ``kv_unified`` | ``llama_context_params::kv_unified`` |
| ``last_error`` | the reason ``llama_decode`` logs when it does not return 0 |
| ``on_device`` | the context also has ``get_logits_ith_device(i)``: the row as an ``mx.array`` |
| ``decode(batch)`` | ``llama_decode`` |
| ``get_logits()``, ``get_logits_ith(i)`` | ``llama_get_logits``, ``llama_get_logits_ith`` |
| ``synchronize()`` | ``llama_synchronize`` |
| ``perf()`` | ``llama_perf_context`` |
| ``state_get_data()``, ``state_set_data(data)`` | ``llama_state_get_data``, ``set_data`` |
| ``state_seq_get_data[_ext]``, ``state_seq_set_data[_ext]`` | ``llama_state_seq_*`` |

[`protocol_mismatches`][] checks an object against a protocol, member by member; a test
holds each of the three contexts to [`ContextLike`][] with it
(``tests/app/test_context_protocol.py``).
"""

from __future__ import annotations

import inspect
import typing
from typing import Protocol

import numpy as np

from reference.batch import Batch
from reference.context import PerfContextData
from reference.hparams import LlamaHParams, MambaHParams


# --8<-- [start:MemoryLike]
class MemoryLike(Protocol):
    """What the programs ask of ``ctx.memory``: ``llama.h``'s ``llama_memory_*`` functions.

    The semantics are the reference's ([`reference.memory.interface.Memory`][]): positions in
    ``[p0, p1)``, ``p0 < 0`` means 0, ``p1 < 0`` means no end, ``seq_id < 0`` every sequence.
    """

    def clear(self, data: bool = True) -> None:
        """``llama_memory_clear``: empty every cell (``data``: also zero the buffers)."""

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """``llama_memory_seq_rm``: False when the memory cannot remove that range."""

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        """``llama_memory_seq_cp``."""

    def seq_keep(self, seq_id: int) -> None:
        """``llama_memory_seq_keep``."""

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """``llama_memory_seq_add``."""

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """``llama_memory_seq_div``."""

    def seq_pos_min(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_min``: -1 when the sequence is empty."""

    def seq_pos_max(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_max``: -1 when the sequence is empty."""

    def can_shift(self) -> bool:
        """``llama_memory_can_shift``: whether ``seq_add`` / ``seq_div`` are allowed."""
# --8<-- [end:MemoryLike]


# --8<-- [start:ContextLike]
class ContextLike(Protocol):
    """What the programs read from a context (``llama.h``'s ``llama_context`` functions).

    Every member is present on every context; ``recurrent`` and ``on_device`` say what the
    context can do, so a program reads them instead of probing for methods.
    """

    @property
    def hparams(self) -> LlamaHParams | MambaHParams:
        """The model's hyperparameters (``llama_hparams``)."""

    @property
    def memory(self) -> MemoryLike:
        """The memory (``llama_get_memory``)."""

    @property
    def n_ctx(self) -> int:
        """Cells of the memory, every stream together (``llama_n_ctx``)."""

    @property
    def n_ctx_seq(self) -> int:
        """Cells one sequence can use (``llama_n_ctx_seq``)."""

    @property
    def n_batch(self) -> int:
        """The most tokens one ``decode`` takes (``llama_n_batch``)."""

    @property
    def n_ubatch(self) -> int:
        """The most tokens one forward takes (``llama_n_ubatch``)."""

    @property
    def n_seq_max(self) -> int:
        """Sequence ids ``0 .. n_seq_max - 1`` (``llama_n_seq_max``)."""

    @property
    def n_vocab(self) -> int:
        """Logits per output row (``llama_vocab_n_tokens``)."""

    @property
    def recurrent(self) -> bool:
        """The memory keeps one state per sequence, not cells per position
        (``llama_model_is_recurrent``): no partial ``seq_rm``, no position shift."""

    @property
    def kv_unified(self) -> bool:
        """One KV stream for every sequence (True) or one per sequence."""

    @property
    def last_error(self) -> str | None:
        """Why the last ``decode`` did not return 0 (None after a success, or unknown)."""

    @property
    def on_device(self) -> bool:
        """The context also has ``get_logits_ith_device(i)``: the row as an ``mx.array``,
        for a sampler that runs on the device."""

    def decode(self, batch: Batch) -> int:
        """``llama_decode``: 0 ok, 1 no memory slot, 2 aborted, -1 invalid batch."""

    def get_logits(self) -> np.ndarray:
        """The last decode's output rows in batch order: ``(n_outputs, n_vocab)``."""

    def get_logits_ith(self, i: int) -> np.ndarray:
        """Row of batch token ``i`` (``i < 0``: counted from the last output): ``(n_vocab,)``."""

    def synchronize(self) -> None:
        """Wait for the work of the last decode (``llama_synchronize``)."""

    def perf(self) -> PerfContextData:
        """Timings and counters (``llama_perf_context``)."""

    def state_get_data(self) -> bytes:
        """The whole context state (``llama_state_get_data``)."""

    def state_set_data(self, data: bytes) -> int:
        """Bytes read back (``llama_state_set_data``); 0 on failure."""

    def state_seq_get_data(self, seq_id: int) -> bytes:
        """One sequence's state (``llama_state_seq_get_data``)."""

    def state_seq_set_data(self, data: bytes, dest_seq_id: int) -> int:
        """Bytes read into ``dest_seq_id`` (``llama_state_seq_set_data``); 0 on failure."""

    def state_seq_get_data_ext(self, seq_id: int, flags: int = 0) -> bytes:
        """``llama_state_seq_get_data_ext`` (``flags``: ``LLAMA_STATE_SEQ_FLAGS_*``)."""

    def state_seq_set_data_ext(self, data: bytes, dest_seq_id: int, flags: int = 0) -> int:
        """``llama_state_seq_set_data_ext``; 0 on failure."""
# --8<-- [end:ContextLike]


# --8<-- [start:protocol_mismatches]
def protocol_mismatches(obj: object, protocol: type) -> list[str]:
    """How ``obj`` falls short of ``protocol``, one line per member (empty: it conforms).

    A method must be callable with the protocol's parameter names; a property must be a
    value, not a method, of its declared type (a protocol type is checked member by member,
    recursively).

    Args:
        obj: the object (e.g. a context).
        protocol: a ``typing.Protocol`` class ([`ContextLike`][], [`MemoryLike`][]).

    Returns:
        One message per missing or mismatched member, in declaration order.

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> protocol_mismatches(Context(hp, random_weights(hp), n_ctx=64), ContextLike)
        []
        >>> class Half:
        ...     def clear(self): pass
        >>> protocol_mismatches(Half(), MemoryLike)[:2]
        ['clear: parameters (), declared (data)', 'seq_rm: missing']
    """
    out = []
    for name, member in _members(protocol).items():
        if not hasattr(obj, name):
            out.append(f"{name}: missing")
        elif isinstance(member, property):
            out += _value_mismatches(name, getattr(obj, name), member)
        else:
            out += _method_mismatches(name, getattr(obj, name), member)
    return out
# --8<-- [end:protocol_mismatches]


def _members(protocol: type) -> dict[str, property | typing.Callable]:
    """The members a protocol declares: its properties and methods, in declaration order."""
    return {name: m for name, m in vars(protocol).items()
            if not name.startswith("_") and (isinstance(m, property) or inspect.isfunction(m))}


def _value_mismatches(name: str, value: object, member: property) -> list[str]:
    """A property's value against its declared return type."""
    kind = typing.get_type_hints(member.fget)["return"]
    if inspect.ismethod(value):
        return [f"{name}: a method, declared a value of type {kind}"]
    if isinstance(kind, type) and Protocol in kind.__mro__:  # checked member by member
        return [f"{name}.{line}" for line in protocol_mismatches(value, kind)]
    if not isinstance(value, kind):
        return [f"{name}: {type(value).__name__}, declared {kind}"]
    return []


def _method_mismatches(name: str, value: object, member: typing.Callable) -> list[str]:
    """A method against the protocol's parameter names (``self`` aside)."""
    if not callable(value):
        return [f"{name}: a {type(value).__name__}, declared a method"]
    want = list(inspect.signature(member).parameters)[1:]
    got = list(inspect.signature(value).parameters)
    if got != want:
        return [f"{name}: parameters ({', '.join(got)}), declared ({', '.join(want)})"]
    return []
