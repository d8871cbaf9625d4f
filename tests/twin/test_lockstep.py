"""Both twins in lock-step: the reference and the MLX Context driven by the same random steps.

The laws run on every Context flavour and model one at a time (``tests/laws/test_decode.py``,
``tests/laws/test_memory.py``, ``tests/laws/test_state.py``, through
``tests/support/helpers.py``); this is the direct comparison. A hypothesis state machine
draws a cache layout (one unified stream or one per sequence) and ``n_ubatch``, builds a
float32 reference Context and an MLX Context, and applies every step to both: random
decodes (valid and mostly invalid ones) and memory operations (``seq_rm`` / ``seq_cp`` /
``seq_keep`` / ``seq_add`` / ``seq_div``, context shift), the rules of
``tests/laws/test_decode_stateful.py``. After every step:

- both hold the same cells (positions, sequence sets, pending shifts) and heads;
- every decode returns the same code on both, with logits that agree (NMSE <= 1e-6, the
  end-to-end bound of the twins); every memory operation the same result or error;
- a failed decode or a refused memory operation leaves the MLX tensors bit-identical.

It runs with the ``ci-deep`` profile in CI (``tests.support.helpers.deep``).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from reference.batch import Batch
from reference.common import MAX_NMSE_TWIN
from reference.context import ContextError, context_shift
from reference.memory import KVCacheError
from tests.support.helpers import MLX, REF_F32, assert_nmse, assert_same, cells_of, deep, snapshot
from tests.support.tiny_models import random_weights, tiny_hparams

HP = tiny_hparams(n_vocab=16, n_embd=8, n_head=2, n_head_kv=1, n_layer=2, n_ff=8,
                  n_ctx_train=4096)
W = random_weights(HP, seed=5)
N_SEQ = 3


class TwinMachine(RuleBasedStateMachine):
    """The reference and the MLX Context driven by the same random steps."""

    @initialize(kv_unified=st.booleans(), n_ubatch=st.integers(1, 9))
    def setup(self, kv_unified, n_ubatch):
        kw = dict(n_ctx=256 * (1 if kv_unified else N_SEQ), n_batch=64, n_ubatch=n_ubatch,
                  n_seq_max=N_SEQ, kv_unified=kv_unified)
        self.ref = REF_F32.make(HP, W, **kw)
        self.acc = MLX.make(HP, W, **kw)

    def both(self, fn):
        """``fn(ctx)`` on both twins: the same result or the same exception type."""
        outcome = []
        for ctx in (self.ref, self.acc):
            try:
                outcome.append(("ok", fn(ctx)))
            except (KVCacheError, ContextError) as e:
                outcome.append(("raised", type(e)))
        assert outcome[0] == outcome[1]
        return outcome[1]

    def decode(self, batch: Batch) -> int:
        self.both(lambda c: c.memory_update())
        before = snapshot(self.acc)
        _, rc = self.both(lambda c: c.decode(batch))
        if rc == 0:
            assert_nmse(self.ref.get_logits(), self.acc.get_logits(), MAX_NMSE_TWIN)
        else:
            assert_same(before, snapshot(self.acc))
        return rc

    @rule(data=st.data(), seqs=st.sets(st.integers(0, N_SEQ - 1), min_size=1),
          n_each=st.integers(1, 3))
    def decode_valid(self, data, seqs, n_each):
        if sum(c.get_used() for c in self.acc.memory.v_cells) > 150:
            self.both(lambda c: c.memory.clear())
        order = data.draw(st.permutations([s for s in sorted(seqs) for _ in range(n_each)]))
        token = [data.draw(st.integers(0, HP.n_vocab - 1)) for _ in order]
        logits = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
        assert self.decode(Batch(token=token, seq_id=[[s] for s in order], logits=logits)) == 0

    @rule(token=st.lists(st.integers(-1, HP.n_vocab), min_size=1, max_size=4),
          pos=st.lists(st.integers(0, 12), min_size=4, max_size=4),
          seq_id=st.lists(st.lists(st.integers(-1, N_SEQ), min_size=1, max_size=2),
                          min_size=4, max_size=4))
    def decode_any(self, token, pos, seq_id):
        n = len(token)
        assert self.decode(Batch(token=token, pos=pos[:n], seq_id=seq_id[:n])) in (0, 1, -1)

    def guarded(self, fn):
        before = snapshot(self.acc)
        if self.both(fn)[0] == "raised":
            assert_same(before, snapshot(self.acc))

    @rule(seq=st.integers(-1, N_SEQ - 1), p0=st.integers(-1, 12), p1=st.integers(-1, 12))
    def seq_rm(self, seq, p0, p1):
        self.guarded(lambda c: c.memory.seq_rm(seq, p0, p1))

    @rule(src=st.integers(0, N_SEQ - 1), dst=st.integers(0, N_SEQ - 1),
          p0=st.integers(-1, 12), p1=st.integers(-1, 12))
    def seq_cp(self, src, dst, p0, p1):
        self.guarded(lambda c: c.memory.seq_cp(src, dst, p0, p1))

    @rule(seq=st.integers(0, N_SEQ - 1))
    def seq_keep(self, seq):
        self.guarded(lambda c: c.memory.seq_keep(seq))

    @rule(seq=st.integers(0, N_SEQ - 1), p0=st.integers(-1, 12), p1=st.integers(-1, 12),
          shift=st.integers(-6, 6))
    def seq_add(self, seq, p0, p1, shift):
        self.guarded(lambda c: c.memory.seq_add(seq, p0, p1, shift))

    @rule(seq=st.integers(0, N_SEQ - 1), p0=st.integers(-1, 12), p1=st.integers(-1, 12),
          d=st.integers(0, 4))
    def seq_div(self, seq, p0, p1, d):
        self.guarded(lambda c: c.memory.seq_div(seq, p0, p1, d))

    @rule(seq=st.integers(-1, N_SEQ), n_keep=st.integers(-1, 6), n_discard=st.integers(0, 6))
    def shift(self, seq, n_keep, n_discard):
        self.guarded(lambda c: context_shift(c, seq, n_keep, n_discard))

    @invariant()
    def same_cells(self):
        if hasattr(self, "acc"):
            assert cells_of(self.ref) == cells_of(self.acc)


TestTwinMachine = TwinMachine.TestCase
TestTwinMachine.settings = deep()
