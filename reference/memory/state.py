r"""State save and restore: ``llama_kv_cache::state_write`` / ``state_read`` as bytes and files.

llama.cpp can save what a context remembers and load it back later, in the same process or
another one (``llama_state_get_data`` / ``llama_state_set_data``, the ``seq_`` variants for
one sequence, ``llama_state_save_file`` / ``llama_state_load_file`` with the prompt's
tokens). What is saved is the memory: for every stream, the non-empty cells (position and
sequence set) and, per layer, their key rows then their value rows
(``state_write_meta`` then ``state_write_data`` in ``src/llama-kv-cache.cpp``).

The law this module is built for:

$$
\mathrm{restore}(\mathrm{save}(M)) \text{ then decode } x
\;=\; \text{decode } x \text{ on } M,
$$

the logits of whatever comes next are those of the uninterrupted memory $M$, and
``state_write(state_read(b)) == b`` (a blob round trip is byte-identical).

What is saved, as llama.cpp at the pinned commit:

- whole memory (``seq_id = -1``): every non-empty cell of every stream, in cell order;
- one sequence: the cells holding it, *except* those the sliding window already hides from
  its last position (``is_masked_swa(n_swa, swa_type, pos, seq_pos_max(seq_id))``). The
  last position itself, not the next one, is the reference: the saved sequence can still
  re-decode its last token (a server does that to get its logits back).

Restoring the whole memory empties it and puts the saved cells at indices $0 \dots n-1$ of
their stream (a fragmented memory comes back compacted: positions, not indices, are what a
cell means). Restoring one sequence into ``dest_seq_id`` first removes ``dest_seq_id``, then
places the saved cells with the cache's own slot search (``find_slot`` on a ubatch built
from the saved cells, as llama.cpp), so the cells need not be contiguous: a restore works
into a fragmented cache.

Where this format differs from llama.cpp's (it is *not* byte-compatible with it):

- a header (magic, version, total size, architecture, a fingerprint of every hyperparameter,
  the cache dtypes, the stream count, the saved sequence) and a SHA-256 trailer. llama.cpp
  writes only the architecture name (in the context wrapper) and relies on per-layer type
  and row-size checks, so a blob of another model of the same shape loads silently;
- each cell also carries its pending K-shift (where llama.cpp writes its ``ext``). A cell
  moved by ``seq_add`` / ``seq_div`` holds its new position but its key is still roped at
  the old one until the next decode's K-shift. llama.cpp's ``state_write_meta`` saves the
  position only, and ``state_read_meta`` restores into a cleared cache (no shift, no
  ``has_shift``): the restored key is the un-shifted key under the shifted position, and it
  is never turned. Here the restored cell gets the same un-shifted key *and* the same
  pending shift, so the next K-shift turns it exactly as it turns the source's. The
  stream's "a shift is pending" answer is not saved as such:
  [`get_has_shift`][reference.memory.kv_cache.KVCache.get_has_shift] is computed from the cells
  (some used cell with a non-zero shift), so the restored memory answers as the source does.
  (llama.cpp's flag also stays set after the shifted cells are freed, a shift below 0 for instance,
  when no key is left to turn; that flag is not state.) Pending stream copies (``seq_cp`` across
  streams) are resolved when writing (the rows are read from the copy's source);
- everything is checked *before* anything changes. llama.cpp removes ``dest_seq_id`` before
  it knows the blob fits, and on a failed read clears the destination (the whole memory for
  a whole restore); here a refused blob leaves the memory exactly as it was;
- restoring an empty sequence blob empties ``dest_seq_id`` (llama.cpp leaves it untouched).

The context wrapper ([`context_state_write`][]) adds the output buffer (logits and output
ids). At the pinned commit llama.cpp's ``llama_context::state_write_data`` no longer saves it
(it writes the architecture name and the memory); it is kept here so that a restored context
answers ``get_logits`` without re-decoding its last token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from reference.batch import Ubatch
from reference.common import DTYPE_OF_GGML_TYPE
from reference.hparams import LlamaHParams, is_masked_swa
from reference.memory.blob import (
    BlobReader,
    BlobWriter,
    StateError,
    check_int32,
    check_tokens,
    ggml_type_name,
    ggml_type_of,
    seal,
    unseal,
    write_atomic,
)
from reference.memory.interface import Memory
from reference.memory.kv_cells import KVCells

if TYPE_CHECKING:  # the cache the functions below read and write; it imports this module
    from reference.memory.kv_cache import KVCache

# --8<-- [start:constants]
STATE_MAGIC = b"LRKV"  # a memory blob (llama.cpp has no magic for it)
STATE_VERSION = 1
CONTEXT_MAGIC = b"LRCX"  # a context blob: outputs + a memory blob
CONTEXT_VERSION = 1
FILE_MAGIC = b"LRSF"  # a state file: tokens + a memory blob (llama.cpp: 'ggsn' / 'ggsq')
FILE_VERSION = 1
LLAMA_STATE_SEQ_FLAGS_NONE = 0  # llama.h: the whole state of a sequence
LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY = 1  # only the partial state (the SWA cache of an iSWA pair)
LLAMA_STATE_SEQ_FLAGS_SWA_ONLY = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # its older name
LLAMA_STATE_SEQ_FLAGS_ON_DEVICE = 2  # llama.h: device buffers; not supported here
SEQ_STATE_MAGIC = 0xAF143CD8  # llama_context's io_magic, before a sequence blob
# --8<-- [end:constants]




# --8<-- [start:check_state_flags]
def check_state_flags(flags: int) -> None:
    """Refuse ``flags`` other than ``NONE`` (0) and ``PARTIAL_ONLY`` (1).

    ``llama_state_seq_flags``: ``PARTIAL_ONLY`` (alias ``SWA_ONLY``) saves and restores
    only the partial part of a memory: the SWA cache of an iSWA pair, the whole state of a
    recurrent memory, everything for a cache alone. ``ON_DEVICE`` (2) keeps the data in
    per-sequence device buffers in llama.cpp; it has no meaning here and is refused.

    Raises:
        StateError: any other value.

    Examples:
        >>> check_state_flags(LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        >>> check_state_flags(2)
        Traceback (most recent call last):
        ...
        reference.memory.blob.StateError: state flags 2 not supported: 0 (NONE) or 1 (PARTIAL_ONLY)
    """
    if flags not in (LLAMA_STATE_SEQ_FLAGS_NONE, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY):
        raise StateError(f"state flags {flags} not supported: 0 (NONE) or 1 (PARTIAL_ONLY)")
# --8<-- [end:check_state_flags]




# --8<-- [start:hparams_fingerprint]
def hparams_fingerprint(hparams: LlamaHParams) -> bytes:
    """SHA-256 of every hyperparameter, as canonical JSON (sorted keys).

    Every field changes what a cached row means: the layout ones (``n_layer``,
    ``n_head_kv``, ``n_embd_head_k/v``) its shape, the RoPE and window ones how keys were
    rotated and which cells matter, and all the others the values themselves (a key of
    layer 1 depends on everything layer 0 computed). Two models with equal hyperparameters
    but different weights share a fingerprint: the weights are not hashed (too costly for a
    save), as llama.cpp does not check them either.

    Args:
        hparams: a dataclass of hyperparameters
            ([`reference.hparams.LlamaHParams`][reference.hparams.LlamaHParams]).

    Returns:
        32 bytes.

    Examples:
        >>> import dataclasses
        >>> from reference.testing import tiny_hparams
        >>> hp = tiny_hparams()
        >>> len(hparams_fingerprint(hp)), hparams_fingerprint(hp) == hparams_fingerprint(hp)
        (32, True)
        >>> other = dataclasses.replace(hp, rope_freq_base_train=5e5)
        >>> hparams_fingerprint(other) == hparams_fingerprint(hp)
        False
    """
    fields = dataclasses.asdict(hparams)
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).digest()
# --8<-- [end:hparams_fingerprint]




# ---------------------------------------------------------------------------------------------
# the parsed form of a memory blob
# ---------------------------------------------------------------------------------------------


# --8<-- [start:StreamState]
@dataclass
class StreamState:
    """The saved cells of one stream, in cell order.

    Attributes:
        pos: position of each cell ``(cell_count,)``.
        shift: pending K-shift of each cell ``(cell_count,)``.
        seq_ids: the sequence ids of each cell, ascending.
        k: per layer, the key rows ``(cell_count, n_embd_k_gqa)``.
        v: per layer, the value rows ``(cell_count, n_embd_v_gqa)``.
    """

    pos: list[int]
    shift: list[int]
    seq_ids: list[tuple[int, ...]]
    k: list[np.ndarray]
    v: list[np.ndarray]

    @property
    def cell_count(self) -> int:
        """Number of saved cells."""
        return len(self.pos)
# --8<-- [end:StreamState]


# --8<-- [start:KVState]
@dataclass
class KVState:
    """A memory blob, parsed: the header fields and one [`StreamState`][] per stream.

    Attributes:
        arch: architecture name (``general.architecture``).
        fingerprint: [`hparams_fingerprint`][] of the writer's hyperparameters.
        k_type: ggml type of the key rows; ``v_type`` of the value rows.
        n_stream: streams of the writer's cache.
        seq_id: the saved sequence, -1 for the whole memory.
        streams: the saved cells, per stream.
    """

    arch: str
    fingerprint: bytes
    k_type: int
    v_type: int
    n_stream: int
    seq_id: int
    streams: list[StreamState]
# --8<-- [end:KVState]


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def _stream_data_source(memory: KVCache) -> list[int]:
    """For each stream, the stream whose K/V rows it holds once pending copies are applied."""
    src = list(range(memory.get_n_stream()))
    for ssrc, sdst in memory.sc_info:  # update() copies t[sdst] = t[ssrc], in this order
        src[sdst] = src[ssrc]
    return src


# --8<-- [start:state_cells]
def state_cells(memory: KVCache, stream: int, seq_id: int) -> list[int]:
    """The cells of ``stream`` that a save writes (``state_write``'s cell ranges, flattened).

    A cell is saved when it is non-empty and, for one sequence, holds ``seq_id`` and is
    not hidden by the sliding window from the sequence's last position. A whole save
    (``seq_id == -1``) keeps every non-empty cell, SWA-masked or not, as llama.cpp.

    Args:
        memory: the cache.
        stream: a stream index.
        seq_id: a sequence id, or -1 for all.

    Returns:
        Cell indices, ascending.

    Examples:
        >>> from reference.memory.kv_cache import KVCache
        >>> from reference.testing import tiny_hparams
        >>> cache = KVCache(tiny_hparams(n_swa=2), kv_size=8)
        >>> for i in range(4):
        ...     cache.v_cells[0].pos_set(i, i); cache.v_cells[0].seq_add(i, 0)
        >>> state_cells(cache, 0, 0), state_cells(cache, 0, -1)
        ([2, 3], [0, 1, 2, 3])
    """
    cells = memory.v_cells[stream]
    if seq_id == -1:
        return np.flatnonzero(cells.pos != -1).tolist()
    idxs = np.flatnonzero(cells.seq[:, seq_id])  # the cells of seq_id
    hidden = is_masked_swa(memory.n_swa, memory.swa_type, cells.pos[idxs],
                           cells.seq_pos_max(seq_id))  # (n,), or False without a window
    return idxs[~np.broadcast_to(hidden, idxs.shape)].tolist()
# --8<-- [end:state_cells]


# --8<-- [start:state_write_meta]
def state_write_meta(io: BlobWriter, cells: KVCells, idxs: list[int], seq_id: int) -> None:
    """Per saved cell: ``pos``, ``n_seq_id``, ``shift``, then its sequence ids (ascending).

    For one sequence, only ``seq_id`` is written (``n_seq_id == 1``), as llama.cpp.
    """
    for i in idxs:
        seq_ids = sorted(cells.seq_get_all(i)) if seq_id == -1 else [seq_id]
        io.write("iIi", cells.pos_get(i), len(seq_ids), cells.get_shift(i))
        for s in seq_ids:
            io.write("i", s)
# --8<-- [end:state_write_meta]


# --8<-- [start:state_write_data]
def state_write_data(io: BlobWriter, memory: KVCache, stream: int, idxs: list[int]) -> None:
    """``v_trans``, ``n_layer``, then per layer the key rows, then per layer the value rows.

    Each layer's block is its ggml type, its row size in bytes, then the rows of the saved
    cells in cell order (V is stored one row per cell, ``v_trans = 0``).
    """
    src = _stream_data_source(memory)[stream]
    io.write("II", 0, len(memory.k_l))
    for tensors in (memory.k_l, memory.v_l):
        for t in tensors:
            write_layer_rows(io, t[src, idxs])  # (cell_count, n_embd_gqa)
# --8<-- [end:state_write_data]


# --8<-- [start:layer_rows]
def write_layer_rows(io: BlobWriter, rows: np.ndarray) -> None:
    """One layer's block of rows: its ggml type (i32), its row size in bytes (u64), the rows.

    The same block carries K and V rows here and the conv and SSM state rows of the
    recurrent memory ([`reference.memory.recurrent`][reference.memory.recurrent]).
    """
    io.write("iQ", ggml_type_of(rows.dtype), rows.dtype.itemsize * rows.shape[-1])
    io.write_array(rows)  # (cell_count, row_size)


def read_layer_rows(
    io: BlobReader, kind: str, t_ref: int, n_layer: int, cell_count: int
) -> list[np.ndarray]:
    """Read ``n_layer`` blocks written by [`write_layer_rows`][], checking each type.

    Raises:
        StateError: a layer's type differs from the header's ``t_ref``, or its row size is
            not a whole number of elements.
    """
    out = []
    for il in range(n_layer):
        t, size_row = io.read("iQ")
        if t != t_ref:
            raise StateError(f"layer {il} {kind} rows are {ggml_type_name(t)}, the header "
                             f"says {ggml_type_name(t_ref)}")
        dtype = DTYPE_OF_GGML_TYPE[t]
        if size_row % dtype.itemsize:
            raise StateError(f"layer {il} {kind} row size {size_row} is not a whole number "
                             f"of {dtype} elements")
        out.append(io.read_array(dtype, (cell_count, size_row // dtype.itemsize)))
    return out
# --8<-- [end:layer_rows]


# --8<-- [start:state_write]
def state_write(memory: KVCache, hparams: LlamaHParams, seq_id: int = -1) -> bytes:
    r"""Save the whole memory, or one sequence, as bytes (``llama_state_get_data``).

    Layout (little-endian; ``u32``/``i32``/``u64`` are 4/4/8 bytes):

    | field | type | value |
    |---|---|---|
    | magic | 4 bytes | ``b"LRKV"`` |
    | version | u32 | 1 |
    | total size | u64 | bytes of the whole blob, checksum included |
    | arch | u32 length + UTF-8 | ``hparams.arch`` |
    | fingerprint | 32 bytes | [`hparams_fingerprint`][] |
    | k_type, v_type | i32, i32 | ggml type of the cache (0 f32, 1 f16, 28 f64) |
    | n_stream | u32 | streams of the cache |
    | seq_id | i32 | the saved sequence, -1 for all |
    | *per stream* | | |
    | cell_count | u32 | saved cells (nothing more for this stream when 0) |
    | *per cell* | i32, u32, i32, i32 x n | ``pos``, ``n_seq_id``, ``shift``, the seq ids |
    | v_trans, n_layer | u32, u32 | 0, ``n_layer`` |
    | *per layer* | | ``k_type`` i32, ``k_size_row`` u64, ``cell_count`` key rows |
    | *per layer* | | ``v_type`` i32, ``v_size_row`` u64, ``cell_count`` value rows |
    | checksum | 32 bytes | SHA-256 of every byte before it |

    Args:
        memory: the cache to save.
        hparams: the model's hyperparameters (those of ``memory``).
        seq_id: the sequence to save, or -1 for the whole memory.

    Returns:
        The blob.

    Raises:
        StateError: ``seq_id`` out of range; ``hparams`` other than the memory's; a cache
            dtype with no ggml type.

    Examples:
        >>> from reference.memory.kv_cache import KVCache
        >>> from reference.testing import tiny_hparams
        >>> hp = tiny_hparams(n_layer=1)
        >>> cache = KVCache(hp, kv_size=8)
        >>> blob = state_write(cache, hp)
        >>> blob[:4], len(blob)
        (b'LRKV', 109)
    """
    _check_memory_hparams(memory, hparams)
    if seq_id != -1 and not 0 <= seq_id < len(memory.seq_to_stream):
        raise StateError(f"seq_id={seq_id} out of range [0, {len(memory.seq_to_stream)}) or -1")
    body = BlobWriter()
    body.write_string(hparams.arch)
    body.write_bytes(hparams_fingerprint(hparams))
    body.write("iiIi", ggml_type_of(memory.dtype), ggml_type_of(memory.dtype),
               memory.get_n_stream(), seq_id)
    for s in range(memory.get_n_stream()):
        idxs = state_cells(memory, s, seq_id)
        body.write("I", len(idxs))
        if idxs:
            state_write_meta(body, memory.v_cells[s], idxs, seq_id)
            state_write_data(body, memory, s, idxs)
    return seal(STATE_MAGIC, STATE_VERSION, body.getvalue())
# --8<-- [end:state_write]




def _check_memory_hparams(memory: KVCache, hparams: LlamaHParams) -> None:
    if hparams_fingerprint(hparams) != hparams_fingerprint(memory.hparams):
        raise StateError("hparams are not those of this memory")


# ---------------------------------------------------------------------------------------------
# reading: parse, check, then apply
# ---------------------------------------------------------------------------------------------


# --8<-- [start:state_parse]
def state_parse(data: bytes) -> KVState:
    """Parse a memory blob, checking its magic, version, size and checksum first.

    Pure: reads nothing but ``data``. Whether the blob fits a given memory is
    [`state_check`][]'s question.

    Args:
        data: a blob from [`state_write`][].

    Returns:
        The [`KVState`][].

    Raises:
        StateError: bad magic, another version, truncated or too long, checksum mismatch,
            an unknown row type, a layer block whose type or row size disagrees with the
            header, bytes left over.

    Examples:
        >>> from reference.memory.kv_cache import KVCache
        >>> from reference.testing import tiny_hparams
        >>> hp = tiny_hparams(n_layer=1)
        >>> state_parse(state_write(KVCache(hp, kv_size=8), hp)).streams[0].cell_count
        0
        >>> state_parse(b"GGUF" + bytes(60))
        Traceback (most recent call last):
        ...
        reference.memory.blob.StateError: bad magic b'GGUF': not a state blob (expected b'LRKV')
    """
    io = unseal(data, STATE_MAGIC, STATE_VERSION, "state blob")
    arch = io.read_string()
    fingerprint = io.read_bytes(32)
    k_type, v_type, n_stream, seq_id = io.read("iiIi")
    for t in (k_type, v_type):
        if t not in DTYPE_OF_GGML_TYPE:
            raise StateError(f"unsupported row type {ggml_type_name(t)}")
    streams = [state_read_stream(io, k_type, v_type) for _ in range(n_stream)]
    if io.off != len(io.data):
        raise StateError(f"state blob has {len(io.data) - io.off} unread bytes before its checksum")
    return KVState(arch, fingerprint, k_type, v_type, n_stream, seq_id, streams)
# --8<-- [end:state_parse]


# --8<-- [start:state_read_stream]
def state_read_stream(io: BlobReader, k_type: int, v_type: int) -> StreamState:
    """One stream of a blob: its cell count, cells (``state_read_meta``), rows (``_data``)."""
    cell_count = io.read("I")
    st = StreamState([], [], [], [], [])
    if cell_count == 0:
        return st
    for _ in range(cell_count):
        pos, n_seq_id, shift = io.read("iIi")
        if n_seq_id > 2**16:
            raise StateError(f"a cell lists {n_seq_id} sequences")
        st.pos.append(pos)
        st.shift.append(shift)
        st.seq_ids.append(tuple(io.read("i") for _ in range(n_seq_id)))
    v_trans, n_layer = io.read("II")
    if v_trans != 0:
        raise StateError("transposed V rows (v_trans = 1) are not supported")
    for kind, t_ref, rows in (("key", k_type, st.k), ("value", v_type, st.v)):
        rows.extend(read_layer_rows(io, kind, t_ref, n_layer, cell_count))
    return st
# --8<-- [end:state_read_stream]


# --8<-- [start:state_check]
def state_check(memory: KVCache, hparams: LlamaHParams, state: KVState, dest_seq_id: int) -> None:
    r"""Everything that must hold for ``state`` to be restored into ``memory``.

    Same architecture and hyperparameters (fingerprint), same cache dtype, same stream count,
    a whole blob for a whole restore and a sequence blob for a sequence restore, per layer
    the row widths of this cache, positions $\ge 0$, sequence ids in range and in their
    stream, and the cell count within the stream size. Whether a sequence finds room is
    checked by the slot search in [`state_read`][].

    Raises:
        StateError: the first rule that fails, named.
    """
    _check_memory_hparams(memory, hparams)
    if state.arch != hparams.arch:
        raise StateError(f"blob written for architecture {state.arch!r}, this model is "
                         f"{hparams.arch!r}")
    if state.fingerprint != hparams_fingerprint(hparams):
        raise StateError("blob written for other hyperparameters (fingerprint "
                         f"{state.fingerprint.hex()[:16]}..., this model "
                         f"{hparams_fingerprint(hparams).hex()[:16]}...): another model")
    want = ggml_type_of(memory.dtype)
    if (state.k_type, state.v_type) != (want, want):
        raise StateError(f"cache dtype mismatch: blob K {ggml_type_name(state.k_type)}, V "
                         f"{ggml_type_name(state.v_type)}; this cache {ggml_type_name(want)}")
    if state.n_stream != memory.get_n_stream():
        raise StateError(f"n_stream mismatch: blob {state.n_stream}, cache {memory.get_n_stream()}")
    n_seq = len(memory.seq_to_stream)
    if dest_seq_id != -1 and not 0 <= dest_seq_id < n_seq:
        raise StateError(f"dest_seq_id={dest_seq_id} out of range [0, {n_seq}) or -1")
    if (state.seq_id == -1) != (dest_seq_id == -1):
        kind = "the whole memory" if state.seq_id == -1 else f"sequence {state.seq_id}"
        raise StateError(f"blob holds {kind}: restore it with dest_seq_id "
                         + ("-1" if state.seq_id == -1 else ">= 0"))
    if dest_seq_id != -1 and sum(st.cell_count > 0 for st in state.streams) > 1:
        raise StateError("a sequence blob with cells in more than one stream")
    hp = memory.hparams
    for s, st in enumerate(state.streams):
        _check_stream(memory, st, s, state.seq_id, hp.n_embd_k_gqa(), hp.n_embd_v_gqa())
# --8<-- [end:state_check]


def _check_stream(memory: KVCache, st: StreamState, s: int, seq_id: int, n_k: int, n_v: int):
    if st.cell_count == 0:
        return
    if st.cell_count > memory.get_size():
        raise StateError(f"does not fit: stream {s} needs {st.cell_count} cells, the cache has "
                         f"{memory.get_size()}")
    if len(st.k) != len(memory.k_l):
        raise StateError(f"blob has {len(st.k)} layers, the cache {len(memory.k_l)}")
    for il, (k, v) in enumerate(zip(st.k, st.v, strict=True)):
        if k.shape[1] != n_k or v.shape[1] != n_v:
            raise StateError(f"layer {il}: rows of {k.shape[1]}/{v.shape[1]} elements (K/V), "
                             f"the cache holds {n_k}/{n_v}")
    n_seq = memory.n_seq_max
    for j, (pos, ids) in enumerate(zip(st.pos, st.seq_ids, strict=True)):
        if pos < 0:
            raise StateError(f"stream {s} cell {j}: position {pos} < 0")
        if not ids or list(ids) != sorted(set(ids)):
            raise StateError(f"stream {s} cell {j}: sequence ids {ids} not ascending and unique")
        if seq_id != -1 and ids != (seq_id,):
            raise StateError(f"stream {s} cell {j}: sequence ids {ids} in a blob of sequence "
                             f"{seq_id}")
        for sid in ids:
            if not 0 <= sid < n_seq:
                raise StateError(f"stream {s} cell {j}: seq_id {sid} out of range [0, {n_seq})")
            if seq_id == -1 and memory.seq_to_stream[sid] != s:
                raise StateError(f"stream {s} cell {j}: seq_id {sid} lives in stream "
                                 f"{memory.seq_to_stream[sid]}")


def _apply_pending_copies(memory: KVCache) -> None:
    """Do the K/V part of [`KVCache.update`][] now: pending stream copies."""
    for ssrc, sdst in memory.sc_info:
        for t in memory.k_l + memory.v_l:
            t[sdst] = t[ssrc]
    memory.sc_info = []


# --8<-- [start:state_read_whole]
def state_read_whole(memory: KVCache, state: KVState) -> None:
    r"""Replace the whole memory by ``state``: clear, then cells $0 \dots n-1$ of each stream."""
    memory.clear(data=True)
    memory.sc_info = []  # the restored rows are complete: no copy may overwrite them
    for s, st in enumerate(state.streams):
        cells = memory.v_cells[s]
        idxs = np.arange(st.cell_count)
        cells.pos_set_cells(idxs, st.pos)
        for sid in sorted({sid for ids in st.seq_ids for sid in ids}):
            cells.seq_add_cells(idxs[[sid in ids for ids in st.seq_ids]], sid)
        cells.shift_set_cells(idxs, st.shift)
        for il in range(len(st.k)):
            memory.k_l[il][s, : st.cell_count] = st.k[il]
            memory.v_l[il][s, : st.cell_count] = st.v[il]
        memory.v_heads[s] = 0
# --8<-- [end:state_read_whole]


def _seq_ubatch(st: StreamState, dest_seq_id: int) -> Ubatch:
    """``ubatch_reserve`` filled with the saved cells, all of ``dest_seq_id``."""
    n = st.cell_count
    return Ubatch(token=np.zeros(n, np.int32), embd=None, pos=np.array(st.pos, np.int32),
                  seq_id=((dest_seq_id,),) * n, seq_id_unq=(dest_seq_id,),
                  output=np.zeros(n, bool), idx=np.arange(n), equal_seqs=False,
                  n_seq_tokens=n, n_seqs=1)


# --8<-- [start:state_read_seq]
def state_read_seq(memory: KVCache, state: KVState, dest_seq_id: int) -> None:
    """Put the saved sequence into ``dest_seq_id``: remove it, find a slot, write the cells.

    As ``state_read_meta``: ``seq_rm(dest_seq_id)``, then ``find_slot`` on a ubatch of the
    saved positions (any free cells, contiguous or not), then ``apply_ubatch``. If no slot
    is found, the cells and head of the stream are put back (the cells' undo journal) and
    [`StateError`][] is raised: the memory is unchanged.
    """
    strm = memory.seq_to_stream[dest_seq_id]
    cells, head = memory.v_cells[strm], memory.v_heads[strm]
    n_replaced = len(cells.seq_pos[dest_seq_id])
    st = next((st for st in state.streams if st.cell_count), None)
    cells.begin()
    memory.seq_rm(dest_seq_id, -1, -1)
    if st is None:  # an empty sequence
        cells.commit()
        return
    ubatch = _seq_ubatch(st, dest_seq_id)
    sinfo = memory.find_slot(ubatch, cont=False)
    if sinfo is None:
        cells.rollback()
        memory.v_heads[strm] = head
        free = memory.get_size() - cells.get_used()
        raise StateError(f"does not fit: sequence needs {st.cell_count} cells, stream {strm} has "
                         f"{free} free (+{n_replaced} of sequence {dest_seq_id} it replaces)")
    cells.commit()
    _apply_pending_copies(memory)
    memory.apply_ubatch(sinfo, ubatch)
    idxs = list(sinfo.idxs[0])
    cells.shift_set_cells(idxs, st.shift)
    for il in range(len(st.k)):
        memory.k_l[il][strm, idxs] = st.k[il]
        memory.v_l[il][strm, idxs] = st.v[il]
# --8<-- [end:state_read_seq]


# --8<-- [start:state_read]
def state_read(memory: KVCache, hparams: LlamaHParams, data: bytes, dest_seq_id: int = -1) -> None:
    """Restore a blob of [`state_write`][] (``llama_state_set_data`` / ``seq_set_data``).

    Everything is checked first ([`state_parse`][], [`state_check`][]); only then does
    the memory change. A whole blob (``dest_seq_id = -1``) replaces the memory; a sequence
    blob goes into ``dest_seq_id`` wherever the slot search finds room.

    Args:
        memory: the cache to restore into.
        hparams: the model's hyperparameters (those of ``memory``).
        data: the blob.
        dest_seq_id: -1 for a whole blob; the destination sequence for a sequence blob.

    Raises:
        StateError: any refusal (see [`state_parse`][], [`state_check`][]; no room for
            the sequence). The memory is then exactly as before the call.

    Examples:
        >>> from reference.memory.kv_cache import KVCache
        >>> from reference.testing import tiny_hparams
        >>> hp = tiny_hparams(n_layer=1)
        >>> a, b = KVCache(hp, kv_size=8, n_seq_max=2), KVCache(hp, kv_size=8, n_seq_max=2)
        >>> a.v_cells[0].pos_set(3, 7); a.v_cells[0].seq_add(3, 1); a.k_l[0][0, 3] = 1.0
        >>> state_read(b, hp, state_write(a, hp, seq_id=1), dest_seq_id=0)
        >>> b.seq_pos_max(0), b.seq_pos_max(1), float(b.k_l[0][0, 0, 0])
        (7, -1, 1.0)
        >>> state_read(b, hp, state_write(a, hp, seq_id=1))
        Traceback (most recent call last):
        ...
        reference.memory.blob.StateError: blob holds sequence 1: restore it with dest_seq_id >= 0
    """
    state_apply(memory, state_prepare(memory, hparams, data, dest_seq_id), dest_seq_id)
# --8<-- [end:state_read]


# --8<-- [start:state_prepare]
def state_prepare(memory: KVCache, hparams: LlamaHParams, data: bytes,
                  dest_seq_id: int = -1) -> KVState:
    """Everything [`state_read`][] checks, without changing anything: the parsed blob.

    [`state_parse`][], [`state_check`][], then for a sequence blob whether the slot search
    finds room once ``dest_seq_id`` is removed (tried, then undone). A memory made of
    several caches (the iSWA pair) prepares every part before it applies any
    ([`state_apply`][]), so that a refusal leaves all of them unchanged.

    Raises:
        StateError: as [`state_read`][].
    """
    state = state_parse(data)
    state_check(memory, hparams, state, dest_seq_id)
    if dest_seq_id != -1:
        st = next((st for st in state.streams if st.cell_count), None)
        strm = memory.seq_to_stream[dest_seq_id]
        cells, head = memory.v_cells[strm], memory.v_heads[strm]
        if st is not None:
            cells.begin()
            try:
                memory.seq_rm(dest_seq_id, -1, -1)
                fits = memory.find_slot(_seq_ubatch(st, dest_seq_id), cont=False) is not None
            finally:
                cells.rollback()
                memory.v_heads[strm] = head
            if not fits:
                free = memory.get_size() - cells.get_used()
                raise StateError(f"does not fit: sequence needs {st.cell_count} cells, stream "
                                 f"{strm} has {free} free (+{len(cells.seq_pos[dest_seq_id])} "
                                 f"of sequence {dest_seq_id} it replaces)")
    return state


def state_apply(memory: KVCache, state: KVState, dest_seq_id: int = -1) -> None:
    """Restore a blob [`state_prepare`][] accepted: the whole memory, or into ``dest_seq_id``."""
    if dest_seq_id == -1:
        state_read_whole(memory, state)
    else:
        state_read_seq(memory, state, dest_seq_id)
# --8<-- [end:state_prepare]


# ---------------------------------------------------------------------------------------------
# files: tokens + a memory blob
# ---------------------------------------------------------------------------------------------




# --8<-- [start:state_save_file]
def state_save_file(
    path: str | Path,
    memory: KVCache,
    hparams: LlamaHParams,
    tokens: ArrayLike,
    seq_id: int = -1,
) -> int:
    """Save the memory (or one sequence) and the tokens it holds to a file.

    ``llama_state_save_file`` / ``llama_state_seq_save_file``. The file is

    | field | type |
    |---|---|
    | magic ``b"LRSF"``, version, total size | 4 bytes, u32, u64 |
    | n_token_count, tokens | u32, ``n_token_count`` x i32 |
    | the memory blob | [`state_write`][] |
    | checksum | SHA-256 of every byte before it |

    written to a temporary file in the same folder and renamed over ``path``, so that a
    crash never leaves half a file under that name.

    Args:
        path: the file.
        memory: the cache.
        hparams: its hyperparameters.
        tokens: the token ids the caller wants back at load time (the prompt so far).
        seq_id: the sequence to save, -1 for all.

    Returns:
        The file's size in bytes.

    Raises:
        StateError: as [`state_write`][].
    """
    check_tokens(tokens)
    return state_file_write(path, tokens, state_write(memory, hparams, seq_id))
# --8<-- [end:state_save_file]




# --8<-- [start:state_file]
def state_file_write(path: str | Path, tokens: ArrayLike, blob: bytes) -> int:
    """The file of [`state_save_file`][] around any memory's blob; returns its size.

    Raises:
        StateError: a token id beyond int32.
    """
    toks = check_tokens(tokens)
    body = BlobWriter()
    body.write("I", toks.size)
    body.write_array(toks.astype(np.int32))
    body.write_bytes(blob)
    data = seal(FILE_MAGIC, FILE_VERSION, body.getvalue())
    write_atomic(path, data)
    return len(data)


def state_file_read(path: str | Path) -> tuple[np.ndarray, bytes]:
    """The tokens ``(n_token_count,)`` int32 and the memory blob of a file of
    [`state_file_write`][], its magic, version, size and checksum checked.

    Raises:
        StateError: a refused file. OSError: the file cannot be read.
    """
    io = unseal(Path(path).read_bytes(), FILE_MAGIC, FILE_VERSION, "state file")
    n_token_count = io.read("I")
    tokens = io.read_array(np.dtype(np.int32), (n_token_count,))
    return tokens, io.read_bytes(len(io.data) - io.off)
# --8<-- [end:state_file]


# --8<-- [start:state_load_file]
def state_load_file(
    path: str | Path, memory: KVCache, hparams: LlamaHParams, dest_seq_id: int = -1
) -> np.ndarray:
    """Restore a file of [`state_save_file`][]; returns its tokens.

    ``llama_state_load_file`` / ``llama_state_seq_load_file``: the file's checksum is checked
    first, then its memory blob is restored as [`state_read`][] does.

    Args:
        path: the file.
        memory: the cache to restore into.
        hparams: its hyperparameters.
        dest_seq_id: -1 for a whole-memory file; the destination for a sequence file.

    Returns:
        The saved tokens ``(n_token_count,)`` int32.

    Raises:
        StateError: a refused file or blob (memory unchanged). OSError: the file cannot be read.

    Examples:
        >>> from reference.memory.kv_cache import KVCache
        >>> import tempfile, pathlib
        >>> from reference.testing import tiny_hparams
        >>> hp = tiny_hparams(n_layer=1)
        >>> cache = KVCache(hp, kv_size=8)
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "s.bin"
        >>> _ = state_save_file(path, cache, hp, [1, 2, 3])
        >>> state_load_file(path, cache, hp).tolist()
        [1, 2, 3]
    """
    tokens, blob = state_file_read(path)
    state_read(memory, hparams, blob, dest_seq_id)
    return tokens
# --8<-- [end:state_load_file]


# ---------------------------------------------------------------------------------------------
# one sequence, with flags: llama_state_seq_get_data_ext / set_data_ext
# ---------------------------------------------------------------------------------------------


# --8<-- [start:seq_state]
def seq_state_write(memory: Memory, hparams: LlamaHParams, seq_id: int,
                    flags: int = LLAMA_STATE_SEQ_FLAGS_NONE) -> bytes:
    """One sequence's state with ``flags`` (``llama_context::state_seq_get_data``).

    As llama.cpp: ``u32 0xaf143cd8`` (``io_magic``), ``i32 seq_id``, then the memory's
    ``state_write(seq_id, flags)``: with ``PARTIAL_ONLY`` the SWA cache of an iSWA pair
    only; the whole state of a recurrent memory or of a single KV cache either way.

    Args:
        memory: the context's memory.
        hparams: its hyperparameters.
        seq_id: the sequence.
        flags: ``LLAMA_STATE_SEQ_FLAGS_NONE`` or ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``.

    Raises:
        StateError: other flags ([`check_state_flags`][]); as the memory's ``state_write``.

    Examples:
        >>> from reference.memory.kv_cache import KVCache
        >>> from reference.testing import tiny_hparams
        >>> hp = tiny_hparams(n_layer=1)
        >>> blob = seq_state_write(KVCache(hp, kv_size=8, n_seq_max=2), hp, 1)
        >>> blob[:4].hex(), blob[4:8].hex(), blob[8:12]
        ('d83c14af', '01000000', b'LRKV')
    """
    check_state_flags(flags)
    return struct.pack("<Ii", SEQ_STATE_MAGIC, seq_id) + memory.state_write(hparams, seq_id, flags)


def seq_state_read(memory: Memory, hparams: LlamaHParams, data: bytes, dest_seq_id: int,
                   flags: int = LLAMA_STATE_SEQ_FLAGS_NONE) -> None:
    """Restore a blob of [`seq_state_write`][] into ``dest_seq_id``
    (``llama_context::state_seq_set_data``).

    The magic is checked; the stored sequence id is not used (the state goes into
    ``dest_seq_id``, as llama.cpp). ``flags`` must be those the blob was written with.

    Raises:
        StateError: no magic, other flags, or any refusal of the memory's ``state_read``
            (another model, corrupted, no room). Nothing changed then; llama.cpp returns 0
            and has cleared the destination sequence (``state_read`` failing part way).
    """
    check_state_flags(flags)
    data = bytes(data)
    if len(data) < 8:
        raise StateError(f"sequence state truncated at byte {len(data)}: the header needs 8")
    magic = struct.unpack("<I", data[:4])[0]
    if magic != SEQ_STATE_MAGIC:
        raise StateError(f"wrong sequence state magic {magic:#010x} (expected "
                         f"{SEQ_STATE_MAGIC:#010x})")
    memory.state_read(hparams, data[8:], dest_seq_id, flags)
# --8<-- [end:seq_state]


# ---------------------------------------------------------------------------------------------
# the context's state: outputs + a memory blob
# ---------------------------------------------------------------------------------------------


# --8<-- [start:context_state_write]
def context_state_write(
    memory: Memory,
    hparams: LlamaHParams,
    logits: np.ndarray | None,
    output_ids: ArrayLike,
) -> bytes:
    """The context's state: its output buffer, then the memory blob.

    | field | type |
    |---|---|
    | magic ``b"LRCX"``, version, total size | 4 bytes, u32, u64 |
    | has_logits | u32 (0: none) |
    | logits type, n_outputs, n_vocab, logits | i32, u32, u32, rows (when has_logits) |
    | n_output_ids, output_ids | u32, i32 each |
    | memory blob size, memory blob | u64, ``memory.state_write(hparams)`` |
    | checksum | SHA-256 of every byte before it |

    ``output_ids`` is stored as the Context keeps it (any int32 sequence, for example the
    logits row of each batch index, -1 for none); it is given back unchanged.

    The memory writes its own blob ([`state_write`][reference.memory.kv_cache.KVCache.state_write]:
    this module's [`state_write`][] for a KV cache,
    [`reference.memory.recurrent.state_write`][reference.memory.recurrent.state_write] for a
    recurrent memory).

    Args:
        memory: the context's memory.
        hparams: its hyperparameters.
        logits: the last decode's logits ``(n_outputs, n_vocab)``, or None.
        output_ids: the output bookkeeping of the last decode ``(n,)``.

    Returns:
        The blob.

    Raises:
        StateError: logits not 2-D or of an unsupported dtype; output ids beyond int32; as
            [`state_write`][].
    """
    body = BlobWriter()
    if logits is None:
        body.write("I", 0)
    else:
        logits = np.asarray(logits)
        if logits.ndim != 2:
            raise StateError(f"logits must be (n_outputs, n_vocab), got shape {logits.shape}")
        body.write("IiII", 1, ggml_type_of(logits.dtype), *logits.shape)
        body.write_array(logits)
    ids = check_int32(output_ids, "output ids")
    body.write("I", ids.size)
    body.write_array(ids.astype(np.int32))
    blob = memory.state_write(hparams)
    body.write("Q", len(blob))
    body.write_bytes(blob)
    return seal(CONTEXT_MAGIC, CONTEXT_VERSION, body.getvalue())
# --8<-- [end:context_state_write]


# --8<-- [start:context_state_read]
def context_state_read(
    memory: Memory, hparams: LlamaHParams, data: bytes
) -> tuple[np.ndarray | None, np.ndarray]:
    """Restore a blob of [`context_state_write`][]; returns ``(logits, output_ids)``.

    The whole blob, the memory blob included (read by ``memory.state_read``), is checked
    before the memory changes.

    Args:
        memory: the context's memory.
        hparams: its hyperparameters.
        data: the blob.

    Returns:
        ``logits`` ``(n_outputs, n_vocab)`` or None, and ``output_ids`` ``(n,)`` int32.

    Raises:
        StateError: any refusal (memory unchanged).

    Examples:
        >>> from reference.memory.kv_cache import KVCache
        >>> from reference.testing import tiny_hparams
        >>> hp = tiny_hparams(n_layer=1)
        >>> cache = KVCache(hp, kv_size=8)
        >>> blob = context_state_write(cache, hp, np.ones((1, hp.n_vocab), np.float32), [0])
        >>> logits, ids = context_state_read(cache, hp, blob)
        >>> logits.shape, ids.tolist()
        ((1, 32), [0])
    """
    io = unseal(data, CONTEXT_MAGIC, CONTEXT_VERSION, "context state")
    logits = None
    if io.read("I"):
        t, n_outputs, n_vocab = io.read("iII")
        if t not in DTYPE_OF_GGML_TYPE:
            raise StateError(f"unsupported logits type {ggml_type_name(t)}")
        logits = io.read_array(DTYPE_OF_GGML_TYPE[t], (n_outputs, n_vocab))
    output_ids = io.read_array(np.dtype(np.int32), (io.read("I"),))
    blob = io.read_bytes(io.read("Q"))
    if io.off != len(io.data):
        raise StateError(f"context state has {len(io.data) - io.off} unread bytes")
    memory.state_read(hparams, blob)
    return logits, output_ids
# --8<-- [end:context_state_read]
