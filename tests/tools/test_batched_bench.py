"""``reference.tools.batched_bench`` (llama.cpp's tools/batched-bench): the plan, the memory each
row leaves, the columns, and the errors."""

from __future__ import annotations

import json

import pytest

from reference.tools.batched_bench import (
    BatchedBenchError,
    BenchRow,
    batched_bench,
    n_ctx_required,
    row_jsonl,
    row_md,
)
from reference.tools.passkey import GlibcRand
from tests.support.helpers import FLAVOURS, REF_F32, make, make_mamba


@pytest.mark.parametrize("flavour", [f for f in FLAVOURS if f.name != "ref-f64"], ids=str)
@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "per-seq"])
@pytest.mark.parametrize("pps", [False, True], ids=["separate", "pps"])
def test_rows_fill_every_sequence_to_pp_plus_tg(flavour, kv_unified, pps):
    """Rows in PP, TG, B order, the ones that do not fit skipped; after the last row every
    sequence holds PP + TG positions (with -pps: the shared prompt, then its own)."""
    ctx = make(flavour, n_ctx=256, n_seq_max=4, kv_unified=kv_unified)
    rows = list(batched_bench(ctx, [16, 40], [8], [1, 4]))
    want = [(pp, 8, pl) for pp in (16, 40) for pl in (1, 4)
            if n_ctx_required(pp, 8, pl, False, kv_unified) <= ctx.n_ctx]
    assert [(r.pp, r.tg, r.pl) for r in rows] == want
    rows = list(batched_bench(ctx, [16], [8], [4], pps=pps))
    assert [r.n_kv for r in rows] == [n_ctx_required(16, 8, 4, pps, kv_unified)]
    assert [ctx.memory.seq_pos_max(s) for s in range(4)] == [23] * 4
    assert [ctx.memory.seq_pos_min(s) for s in range(4)] == [0] * 4


def test_tg_separate_and_mamba():
    """``-tgs`` on a recurrent memory with a shared prompt: the state is copied, no dummy
    token is needed (a recurrent memory could not remove it)."""
    ctx = make_mamba(REF_F32, "mamba2", n_seq_max=3)
    rows = list(batched_bench(ctx, [8], [4], [3], pps=True, tgs=True))
    assert len(rows) == 1 and rows[0].speed_tg > 0
    assert [ctx.memory.seq_pos_max(s) for s in range(3)] == [11] * 3


def test_the_tokens_are_glibc_rand():
    """16 warm-up tokens, then the prompt's: ``rand() % n_vocab`` from seed 1."""
    seen = []
    ctx = make(REF_F32, n_seq_max=1)
    decode = ctx.decode
    ctx.decode = lambda batch: seen.append(list(batch.token)) or decode(batch)
    list(batched_bench(ctx, [4], [1], [1]))
    rand = GlibcRand()
    assert seen[0] == [rand() % 32 for _ in range(16)]
    assert seen[1] == [rand() % 32 for _ in range(4)]


def test_the_columns_are_llamacpps():
    r = BenchRow(pp=128, tg=32, pl=4, n_kv=640, t_pp=0.5, t_tg=2.0, is_pp_shared=False)
    assert (r.speed_pp, r.speed_tg, r.t, r.speed) == (1024.0, 64.0, 2.5, 256.0)
    assert row_md(r).split("|")[1:5] == ["   128 ", "     32 ", "    4 ", "    640 "]
    line = json.loads(row_jsonl(r, {"n_kv_max": 1024}))
    assert line["speed_tg"] == 64.0 and list(line)[:2] == ["n_kv_max", "pp"]


@pytest.mark.parametrize(("lists", "message"), [
    (([0], [4], [1]), "-npp 0: every value must be >= 1"),
    (([8], [4], [1, 8]), "-npl 8 needs 8 sequences and the context has 4"),
])
def test_errors_come_before_any_decode(lists, message):
    ctx = make(REF_F32, n_seq_max=4)
    with pytest.raises(BatchedBenchError, match=message):
        list(batched_bench(ctx, *lists))
    assert ctx.n_outputs == 0 and ctx.memory.seq_pos_max(0) == -1
