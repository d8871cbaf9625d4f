"""The extended sequence-state API and the state of the iSWA memory.

``llama_state_seq_get_data_ext`` / ``set_data_ext`` with ``llama_state_seq_flags``
(reference/context.py, reference/memory/state.py, reference/memory/kv_cache_iswa.py):

- the blob is llama.cpp's: ``u32 0xaf143cd8``, ``i32 seq_id``, then the memory's state;
  ``state_seq_get_data`` is the ``_ext`` form with no flags;
- ``PARTIAL_ONLY`` (alias ``SWA_ONLY``) keeps the SWA cache of an iSWA memory only; a plain
  KV cache and a recurrent memory write the same bytes with either flag;
- save, then restore and continue == continue uninterrupted: whole memory (bytes and
  files), one sequence into another id, and a partial state restored onto a sequence whose
  base-cache part is still there (also after the SWA cache reused cells);
- the whole state of an iSWA memory is its base cache then its SWA cache;
- every refusal (a partial blob for a whole read or the reverse, truncated, corrupted,
  another model, no room, bad magic, unknown flags) raises ``StateError`` and changes
  nothing: the context's state bytes are those before.

On every flavour (``STATE_FLAVOURS``: the reference in float64 and float32, the MLX twin);
a state written by one twin restores in the other.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.memory import (
    LLAMA_STATE_SEQ_FLAGS_NONE,
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
    LLAMA_STATE_SEQ_FLAGS_SWA_ONLY,
    KVCacheISWA,
    StateError,
)
from reference.memory.kv_cache_iswa import parse_iswa_state
from reference.memory.state import SEQ_STATE_MAGIC, context_state_read, state_parse
from tests.support.helpers import MLX, REF_F32, REF_F64, assert_between, make, make_mamba
from tests.laws.test_kv_cache_iswa import (
    N_VOCAB,
    decode,
    iswa_model,
    make_iswa,
    n_swa_st,
    patterns_st,
)

NONE, PARTIAL = LLAMA_STATE_SEQ_FLAGS_NONE, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
STATE_FLAVOURS = (REF_F64, REF_F32, MLX)
every_iswa_flavour = pytest.mark.parametrize("flavour", STATE_FLAVOURS, ids=str)
prompt_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=9, max_size=14)
tail_st = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=5)


def memory_blob(ctx) -> bytes:
    """The memory's part of the context's whole state (outputs left out)."""
    return ctx.memory.state_write(ctx.hparams)


# ---- the blob ------------------------------------------------------------------------------------


def test_flags_are_llama_h():
    assert (NONE, PARTIAL, LLAMA_STATE_SEQ_FLAGS_SWA_ONLY) == (0, 1, 1)


@every_iswa_flavour
def test_seq_blob_is_magic_seq_id_then_the_memory(flavour):
    ctx = make_iswa(flavour, "5:1", 4, n_seq_max=3)
    decode(ctx, list(range(1, 10)), seq=2)
    blob = ctx.state_seq_get_data_ext(2, NONE)
    assert struct.unpack("<Ii", blob[:8]) == (SEQ_STATE_MAGIC, 2)
    assert blob[8:] == ctx.memory.state_write(ctx.hparams, 2, NONE)
    assert ctx.state_seq_get_data(2) == blob  # llama_state_seq_get_data = _ext(..., 0)
    partial = ctx.state_seq_get_data_ext(2, PARTIAL)
    assert partial[8:] == ctx.memory.state_write(ctx.hparams, 2, PARTIAL)
    assert len(partial) < len(blob)


@every_iswa_flavour
def test_whole_state_is_base_then_swa(flavour):
    ctx = make_iswa(flavour, "5:1", 4, n_ctx=512, n_batch=512, n_ubatch=8, swa_full=False)
    tokens = np.random.default_rng(4).integers(0, N_VOCAB, 270).tolist()
    decode(ctx, tokens)
    mem = ctx.memory
    base, swa = parse_iswa_state(memory_blob(ctx), NONE, [mem.kv_base.layers,
                                                          mem.kv_swa.layers])
    assert base == mem.kv_base.state_write(ctx.hparams)
    assert swa == mem.kv_swa.state_write(ctx.hparams)
    assert state_parse(base).streams[0].pos == list(range(270))  # every position
    swa_pos = state_parse(swa).streams[0].pos  # the SWA cache has forgotten the oldest
    assert len(swa_pos) <= 256 and max(swa_pos) == 269
    [part] = parse_iswa_state(mem.state_write(ctx.hparams, 0, PARTIAL), PARTIAL,
                              [mem.kv_swa.layers])
    assert state_parse(part).streams[0].pos == [266, 267, 268, 269]  # the window of 269


@pytest.mark.parametrize("kind", ["kv", "mamba", "mamba2"])
def test_partial_is_everything_for_a_single_memory(kind):
    """A plain KV cache and a recurrent memory have no partial part: the same bytes."""
    ctx = make(REF_F64, n_seq_max=2) if kind == "kv" else make_mamba(REF_F64, kind)
    decode(ctx, [1, 2, 3, 4], seq=1)
    whole = ctx.state_seq_get_data_ext(1, NONE)
    assert ctx.state_seq_get_data_ext(1, PARTIAL) == whole
    before = ctx.state_get_data()
    assert ctx.state_seq_set_data_ext(whole, 1, PARTIAL) == len(whole)
    assert ctx.state_get_data() == before


# ---- save, restore, continue == uninterrupted ---------------------------------------------------


@every_iswa_flavour
@given(pattern=patterns_st, n_swa=n_swa_st, prompt=prompt_st, tail=tail_st)
def test_whole_state_restores_and_continues(flavour, pattern, n_swa, prompt, tail):
    src = make_iswa(flavour, pattern, n_swa)
    decode(src, prompt)
    blob = src.state_get_data()
    want = decode(src, tail)
    dst = make_iswa(flavour, pattern, n_swa)
    decode(dst, [3, 1, 4])  # something to replace
    assert dst.state_set_data(blob) == len(blob)
    assert dst.state_get_data() == blob  # byte-identical round trip
    flavour.assert_close(want, decode(dst, tail))


@every_iswa_flavour
@given(pattern=patterns_st, n_swa=n_swa_st, prompt=prompt_st, tail=tail_st)
def test_seq_state_restores_into_another_sequence(flavour, pattern, n_swa, prompt, tail):
    src = make_iswa(flavour, pattern, n_swa, n_seq_max=2)
    decode(src, prompt, seq=0)
    blob = src.state_seq_get_data_ext(0, NONE)
    want = decode(src, tail, seq=0)
    dst = make_iswa(flavour, pattern, n_swa, n_seq_max=2)
    decode(dst, [5, 6, 7], seq=0)  # another sequence stays
    assert dst.state_seq_set_data_ext(blob, 1, NONE) == len(blob)
    # the SWA part brings back the window of the last position, the base part everything
    assert (dst.memory.seq_pos_min(1), dst.memory.seq_pos_max(1)) == (len(prompt) - n_swa,
                                                                      len(prompt) - 1)
    assert dst.memory.kv_base.seq_pos_min(1) == 0
    flavour.assert_close(want, decode(dst, tail, seq=1))
    assert dst.memory.seq_pos_max(0) == 2


def rewind_and_restore(ctx, partial: bytes, n_prompt: int, seq: int = 0) -> None:
    """Roll the sequence back to the checkpoint (both caches), then restore its SWA part."""
    assert ctx.memory.seq_rm(seq, n_prompt, -1)
    assert ctx.state_seq_set_data_ext(partial, seq, PARTIAL) == len(partial)


@every_iswa_flavour
@given(pattern=st.sampled_from(["1:1", "5:1"]), n_swa=n_swa_st, prompt=prompt_st,
       detour=tail_st, tail=tail_st)
def test_partial_state_restores_onto_the_base_part(flavour, pattern, n_swa, prompt, detour,
                                                    tail):
    """A server's checkpoint: save the SWA part at the end of the prompt, go on, roll both
    caches back to the prompt, restore the SWA part: the continuation is the uninterrupted
    one."""
    ctx = make_iswa(flavour, pattern, n_swa)
    decode(ctx, prompt)
    partial = ctx.state_seq_get_data_ext(0, PARTIAL)
    want = decode(make_iswa(flavour, pattern, n_swa), prompt + tail)[len(prompt):]
    decode(ctx, detour)
    rewind_and_restore(ctx, partial, len(prompt))
    assert ctx.memory.seq_pos_max(0) == len(prompt) - 1
    assert ctx.memory.seq_pos_min(0) == len(prompt) - n_swa  # only the window came back
    flavour.assert_close(want, decode(ctx, tail))


@every_iswa_flavour
def test_partial_state_after_cells_were_reused(flavour):
    """The same, past the SWA cache's size: the detour overwrote the checkpoint's cells."""
    kw = dict(n_ctx=512, n_batch=64, n_ubatch=8, swa_full=False)
    rng = np.random.default_rng(5)
    prompt, detour, tail = (rng.integers(0, N_VOCAB, n).tolist() for n in (200, 260, 4))
    ctx = make_iswa(flavour, "1:1", 4, **kw)
    for i in range(0, len(prompt), 50):
        decode(ctx, prompt[i:i + 50])
    partial = ctx.state_seq_get_data_ext(0, PARTIAL)
    for i in range(0, len(detour), 52):
        decode(ctx, detour[i:i + 52])
    assert ctx.memory.kv_swa.seq_pos_min(0) > 199  # the window of 199 is gone from the cache
    rewind_and_restore(ctx, partial, len(prompt))
    uninterrupted = make_iswa(flavour, "1:1", 4, **kw)
    for i in range(0, len(prompt), 50):
        decode(uninterrupted, prompt[i:i + 50])
    flavour.assert_close(decode(uninterrupted, tail), decode(ctx, tail))


@pytest.mark.parametrize(("writer", "reader"), [(MLX, REF_F32), (REF_F32, MLX)], ids=str)
@pytest.mark.parametrize("flags", [NONE, PARTIAL])
def test_a_state_crosses_the_twins(writer, reader, flags):
    """A sequence state written by one twin restores in the other (same dtype) and goes on as
    the writer goes on; the whole state too."""
    prompt, tail = list(range(1, 16)), [4, 2, 9]
    src = make_iswa(writer, "5:1", 4)
    decode(src, prompt)
    blob, whole = src.state_seq_get_data_ext(0, flags), src.state_get_data()
    want = decode(src, tail)
    dst = make_iswa(reader, "5:1", 4)
    decode(dst, prompt + [7, 7])  # the base part, for a partial state, and a detour
    assert dst.memory.seq_rm(0, len(prompt), -1)
    assert dst.state_seq_set_data_ext(blob, 0, flags) == len(blob)
    assert_between(writer, reader, want, decode(dst, tail))
    other = make_iswa(reader, "5:1", 4)
    assert other.state_set_data(whole) == len(whole)
    assert_between(writer, reader, want, decode(other, tail))


@every_iswa_flavour
def test_state_files_round_trip(flavour, tmp_path):
    src = make_iswa(flavour, "5:1", 4, n_seq_max=2)
    decode(src, list(range(1, 12)), seq=1)
    n = src.state_seq_save_file(tmp_path / "seq.bin", 1, list(range(1, 12)))
    n_whole = src.state_save_file(tmp_path / "whole.bin", [9, 9])
    want = decode(src, [3], seq=1)
    assert n == (tmp_path / "seq.bin").stat().st_size and n_whole > 0
    dst = make_iswa(flavour, "5:1", 4, n_seq_max=2)
    assert dst.state_seq_load_file(tmp_path / "seq.bin", 0).tolist() == list(range(1, 12))
    flavour.assert_close(want, decode(dst, [3], seq=0))
    dst2 = make_iswa(flavour, "5:1", 4, n_seq_max=2)
    assert dst2.state_load_file(tmp_path / "whole.bin").tolist() == [9, 9]
    flavour.assert_close(want, decode(dst2, [3], seq=1))


# ---- refusals: StateError, nothing changed -----------------------------------------------------


def refusals(flavour):
    """(name, blob, dest_seq_id, flags, message) for a two-sequence iSWA context."""
    src = make_iswa(flavour, "1:1", 4, n_seq_max=2)
    decode(src, list(range(1, 13)))
    whole = src.state_seq_get_data_ext(0, NONE)
    partial = src.state_seq_get_data_ext(0, PARTIAL)
    other_hp, other_w = iswa_model("1:1", 5, flavour.dtype)
    other = flavour.make(other_hp, other_w, n_ctx=256, n_seq_max=2)
    decode(other, list(range(1, 13)))
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0x10
    big = make_iswa(flavour, "1:1", 4, n_seq_max=2, n_ctx=512, n_batch=512)
    decode(big, np.random.default_rng(6).integers(0, N_VOCAB, 300).tolist())
    return [
        ("partial blob, whole read", partial, 1, NONE, "cannot be read with flags 0"),
        ("whole blob, partial read", whole, 1, PARTIAL, "cannot be read with flags 1"),
        ("truncated", whole[: len(whole) - 7], 1, NONE, "truncated"),
        ("header only", whole[:6], 1, NONE, "truncated"),
        ("corrupted", bytes(flipped), 1, NONE, "checksum"),
        ("bad magic", b"\0\0\0\0" + whole[4:], 1, NONE, "magic"),
        ("another model", other.state_seq_get_data_ext(0, NONE), 1, NONE, "hyperparameters"),
        ("another model, partial", other.state_seq_get_data_ext(0, PARTIAL), 1, PARTIAL,
         "hyperparameters"),
        ("does not fit", big.state_seq_get_data_ext(0, NONE), 1, NONE, "does not fit"),
        ("unknown flags", whole, 1, 2, "flags 2 not supported"),
        ("dest out of range", whole, -5, NONE, "out of range"),
    ]


@every_iswa_flavour
def test_every_refusal_changes_nothing(flavour):
    cases = refusals(flavour)
    for name, blob, dest, flags, message in cases:
        ctx = make_iswa(flavour, "1:1", 4, n_seq_max=2)
        decode(ctx, [7, 7, 1, 2, 3, 4, 5, 6, 8], seq=0)
        decode(ctx, [2] * 200, seq=1)
        before = ctx.state_get_data()
        with pytest.raises(StateError, match=message):
            ctx.state_seq_set_data_ext(blob, dest, flags)
        assert ctx.state_get_data() == before, name


@every_iswa_flavour
def test_a_whole_blob_of_another_memory_is_refused(flavour):
    ctx = make_iswa(flavour, "1:1", 4)
    decode(ctx, [1, 2, 3])
    plain = make(flavour)
    decode(plain, [1, 2, 3])
    before = ctx.state_get_data()
    with pytest.raises(StateError, match="magic"):
        ctx.state_set_data(plain.state_get_data())
    with pytest.raises(StateError):
        context_state_read(ctx.memory, ctx.hparams, before[:-1])
    assert ctx.state_get_data() == before


@every_iswa_flavour
def test_a_refused_swa_part_leaves_the_restored_base_untouched(flavour):
    """The base part fits, the SWA part does not: nothing is written (llama.cpp restores the
    base before it finds the SWA part has no room)."""
    src = make_iswa(flavour, "1:1", 4, n_seq_max=3)
    decode(src, list(range(1, 10)))
    blob = src.state_seq_get_data_ext(0, NONE)
    hp, w = iswa_model("1:1", 4, flavour.dtype)
    ctx = flavour.make(hp, w, n_ctx=512, n_batch=512, n_ubatch=8, n_seq_max=3,
                       swa_full=False)  # base 512 cells, SWA 256
    decode(ctx, np.random.default_rng(7).integers(0, N_VOCAB, 253).tolist(), seq=1)
    ctx.memory.seq_cp(1, 2, -1, -1)  # shared cells: the SWA cache cannot reuse its 253
    before = ctx.state_get_data()
    assert ctx.memory.kv_base.get_size() - ctx.memory.kv_base.v_cells[0].get_used() >= 9
    with pytest.raises(StateError, match="does not fit"):
        ctx.state_seq_set_data_ext(blob, 0, NONE)
    assert ctx.state_get_data() == before
    assert isinstance(ctx.memory, KVCacheISWA)
