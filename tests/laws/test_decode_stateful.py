"""A hypothesis state machine drives a Context with random decodes and memory ops.

Each machine draws its cache layout (one unified stream or one per sequence) and its
``n_ubatch`` once; the rules then decode valid batches (several sequences, interleaved,
cut into ubatches), invalid ones, batches too large for the free cells, and apply
``seq_rm`` / ``seq_cp`` / ``seq_keep`` / ``seq_add`` / ``seq_div`` / ``clear`` /
``context_shift`` with random arguments. After every step:

- ``seq_pos_min`` / ``seq_pos_max`` of every sequence agree with a scan of the cells;
- no cell leaks: a cell is used iff it has a position iff it holds a sequence, and the
  cache's used count is the number of such cells;
- every KQ mask a decode computed equals its brute-force definition over the cells at
  that moment (non-empty, same sequence, causal, same stream);
- a decode that failed (-1 or 1) or a memory op that raised changed nothing: cells,
  heads, K and V bit-identical to a deep copy taken before.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from reference.batch import Batch
from reference.context import Context, ContextError, context_shift
from reference.memory import KVCacheError
from tests.support.helpers import assert_same, deep, snapshot
from tests.support.tiny_models import random_weights, tiny_hparams

N_SEQ = 3
HP = tiny_hparams(n_vocab=16, n_embd=8, n_head=2, n_head_kv=1, n_layer=1, n_ff=8,
                  n_ctx_train=4096)
W = random_weights(HP, seed=5)
N_CTX = 256  # per stream; decodes fill it at most ~3/4 before a clear


def brute_mask(mem, ubatch, strm, n_kv) -> np.ndarray:
    """The KQ mask from its definition, one cell at a time."""
    mask = np.full((ubatch.n_tokens, len(strm) * n_kv), -np.inf)
    for i in range(ubatch.n_tokens):
        s, p = ubatch.seq_id[i][0], int(ubatch.pos[i])
        for b, stream in enumerate(strm):
            cells = mem.v_cells[stream]
            for j in range(n_kv):
                if (stream == mem.seq_to_stream[s] and cells.pos[j] != -1 and cells.seq[j, s]
                        and cells.pos[j] <= p):
                    mask[i, b * n_kv + j] = 0.0
    return mask


class DecodeMachine(RuleBasedStateMachine):
    @initialize(kv_unified=st.booleans(), n_ubatch=st.integers(1, 9))
    def setup(self, kv_unified, n_ubatch):
        n_ctx = N_CTX if kv_unified else N_CTX * N_SEQ
        self.ctx = Context(HP, W, n_ctx=n_ctx, n_batch=64, n_ubatch=n_ubatch, n_seq_max=N_SEQ,
                           kv_unified=kv_unified)
        self.masks_checked = 0
        mem = self.ctx.memory
        attn_input = mem.attn_input

        def checked_attn_input(ubatch, sinfo):
            inp = attn_input(ubatch, sinfo)
            expected = brute_mask(mem, ubatch, sinfo.strm, inp.n_kv)
            np.testing.assert_array_equal(inp.get_kq_mask(0), expected)
            self.masks_checked += 1
            return inp

        mem.attn_input = checked_attn_input

    # ---- decodes ------------------------------------------------------------------------------

    @rule(data=st.data(), seqs=st.sets(st.integers(0, N_SEQ - 1), min_size=1),
          n_each=st.integers(1, 4), auto_pos=st.booleans())
    def decode_valid(self, data, seqs, n_each, auto_pos):
        mem = self.ctx.memory
        if sum(c.get_used() for c in mem.v_cells) > 3 * N_CTX // 4:
            mem.clear()
        order = data.draw(st.permutations([s for s in sorted(seqs) for _ in range(n_each)]))
        nxt = {s: mem.seq_pos_max(s) + 1 for s in seqs}
        token, pos = [], []
        for s in order:
            token.append(data.draw(st.integers(0, HP.n_vocab - 1)))
            pos.append(nxt[s])
            nxt[s] += 1
        logits = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
        rc = self.ctx.decode(Batch(token=token, pos=None if auto_pos else pos,
                                   seq_id=[[s] for s in order], logits=logits))
        assert rc == 0, self.ctx.last_error
        assert self.ctx.n_outputs == sum(logits)
        for s in seqs:
            assert mem.seq_pos_max(s) == nxt[s] - 1

    @rule(token=st.lists(st.integers(-1, HP.n_vocab), min_size=1, max_size=4),
          pos=st.lists(st.integers(0, 12), min_size=4, max_size=4),
          seq_id=st.lists(st.lists(st.integers(-1, N_SEQ), min_size=1, max_size=2),
                          min_size=4, max_size=4))
    def decode_any(self, token, pos, seq_id):
        """A random batch: mostly invalid; a failure must change nothing."""
        n = len(token)
        self.ctx.memory_update()
        before = snapshot(self.ctx)
        rc = self.ctx.decode(Batch(token=token, pos=pos[:n], seq_id=seq_id[:n]))
        assert rc in (0, 1, -1)
        if rc != 0:
            assert_same(before, snapshot(self.ctx))

    @rule(seq=st.integers(0, N_SEQ - 1))
    def decode_too_large(self, seq):
        """64 tokens after filling the stream of ``seq`` to 220 cells: no slot (1)."""
        mem = self.ctx.memory
        stream = mem.seq_to_stream[seq]
        free = N_CTX - mem.v_cells[stream].get_used()
        if free > 60:  # fill up with ``seq`` first, in batches of at most n_batch
            p = mem.seq_pos_max(seq) + 1
            n_fill = free - 36
            while n_fill > 0:
                k = min(64, n_fill)
                assert self.ctx.decode(Batch(token=[1] * k, pos=list(range(p, p + k)),
                                             seq_id=[[seq]] * k)) == 0
                p, n_fill = p + k, n_fill - k
        self.ctx.memory_update()
        before = snapshot(self.ctx)
        assert self.ctx.decode(Batch(token=[2] * 64, seq_id=[[seq]] * 64)) == 1
        assert_same(before, snapshot(self.ctx))

    # ---- memory ops ---------------------------------------------------------------------------

    def guarded(self, fn, *args):
        """Run a memory op; if it raises, it must have changed nothing."""
        before = snapshot(self.ctx)
        try:
            fn(*args)
        except (KVCacheError, ContextError):
            assert_same(before, snapshot(self.ctx))

    @rule(seq=st.integers(-1, N_SEQ - 1), p0=st.integers(-1, 12), p1=st.integers(-1, 12))
    def seq_rm(self, seq, p0, p1):
        assert self.ctx.memory.seq_rm(seq, p0, p1) is True

    @rule(src=st.integers(0, N_SEQ - 1), dst=st.integers(0, N_SEQ - 1),
          p0=st.integers(-1, 12), p1=st.integers(-1, 12))
    def seq_cp(self, src, dst, p0, p1):
        self.guarded(self.ctx.memory.seq_cp, src, dst, p0, p1)

    @rule(seq=st.integers(0, N_SEQ - 1))
    def seq_keep(self, seq):
        self.ctx.memory.seq_keep(seq)

    @rule(seq=st.integers(0, N_SEQ - 1), p0=st.integers(-1, 12), p1=st.integers(-1, 12),
          shift=st.integers(-6, 6))
    def seq_add(self, seq, p0, p1, shift):
        self.ctx.memory.seq_add(seq, p0, p1, shift)

    @rule(seq=st.integers(0, N_SEQ - 1), p0=st.integers(-1, 12), p1=st.integers(-1, 12),
          d=st.integers(0, 4))
    def seq_div(self, seq, p0, p1, d):
        self.guarded(self.ctx.memory.seq_div, seq, p0, p1, d)

    @rule(seq=st.integers(-1, N_SEQ), n_keep=st.integers(-1, 6), n_discard=st.integers(0, 6))
    def shift(self, seq, n_keep, n_discard):
        self.guarded(context_shift, self.ctx, seq, n_keep, n_discard)

    @rule(data=st.booleans())
    def clear(self, data):
        self.ctx.memory.clear(data)

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def cells_are_consistent(self):
        mem = self.ctx.memory
        for cells in mem.v_cells:
            with_seq = [i for i in range(cells.size()) if cells.seq[i].any()]
            with_pos = [i for i in range(cells.size()) if cells.pos[i] != -1]
            assert with_seq == with_pos, "a cell with a position but no sequence (or reverse)"
            assert cells.get_used() == len(with_seq), "used count != cells holding a sequence"
        for s in range(N_SEQ):
            cells = mem.v_cells[mem.seq_to_stream[s]]
            ps = [cells.pos[i] for i in range(cells.size()) if cells.seq[i, s]]
            assert mem.seq_pos_min(s) == (min(ps) if ps else -1)
            assert mem.seq_pos_max(s) == (max(ps) if ps else -1)
        if not mem.kv_unified:  # a sequence lives in its own stream only
            for s, cells in enumerate(mem.v_cells):
                assert all(cells.seq_get_all(i) <= {s} for i in range(cells.size()))


TestDecodeMachine = DecodeMachine.TestCase
TestDecodeMachine.settings = deep()  # ci: ci-deep, 100 machines of up to 50 steps
