"""Scripted memory-and-decode scenarios, as data, run on llama.cpp and on our Context alike.

A :class:`Scenario` is a tiny model name, the context parameters and a list of steps:
:class:`Decode` (a batch), the memory ops (:class:`SeqRm`, :class:`SeqCp`, :class:`SeqKeep`,
:class:`SeqAdd`, :class:`SeqDiv`, :class:`Clear`) and :class:`ContextShift` (llama.cpp's
"drop ``n_discard`` tokens after ``n_keep``, shift the rest back" built on ``seq_rm`` +
``seq_add``). :func:`run` plays the steps on any context with our Context's method names
(:class:`llamaref.llamacpp.LlamaCppContext` or :class:`reference.context.Context`) and
returns one :class:`Observation` per step: the return code and the output logits of a decode,
the bool of ``seq_rm``, and after every step ``(seq_pos_min, seq_pos_max)`` of each sequence.

Two runs agree (:func:`compare_observations`) when every return code, every ``seq_rm`` result
and every position range is equal and the logits of each decode have NMSE <= 1e-6.

Context sizes are chosen so that llama.cpp's padding changes nothing: ``n_ctx`` per stream
is a multiple of 256 (llama.cpp pads ``n_ctx`` to 256, see :mod:`llamaref.llamacpp`)
and ``n_batch <= n_ctx``.

Scenarios on the one-layer model (``"one_layer"``) are those whose expected logits come from a
"fresh decode with the same cache contents": with one layer, a cell's K and V depend only on its
token and its position, so a cache edited by ``seq_add`` / ``seq_div`` / a context shift holds
exactly what a fresh decode of the same tokens at the new positions would write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# ---------------------------------------------------------------------------------------------
# Models


MODELS = {  # name -> tiny_hparams kwargs (random_weights seed 1)
    "two_layer": dict(n_vocab=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, n_ff=48),
    "one_layer": dict(n_vocab=64, n_embd=32, n_layer=1, n_head=4, n_head_kv=2, n_ff=48),
}


def tiny_model(name: str):
    """``(hparams, weights)`` of the tiny float32 model ``name`` (a key of :data:`MODELS`)."""
    from tests.support.tiny_models import random_weights, tiny_hparams

    hp = tiny_hparams(n_ctx_train=4096, **MODELS[name])
    return hp, random_weights(hp, seed=1)


def toks(seed: int, n: int, n_vocab: int = 64) -> tuple[int, ...]:
    """``n`` seeded random token ids."""
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, n_vocab, n))


# ---------------------------------------------------------------------------------------------
# Steps


@dataclass(frozen=True)
class Decode:
    """A batch: the fields of ``llama_batch`` / our ``Batch`` (``None`` = llama.cpp's default:
    positions from memory, seq 0, logits for the last token)."""

    token: tuple[int, ...]
    pos: tuple[int, ...] | None = None
    seq_id: tuple[tuple[int, ...], ...] | None = None
    logits: tuple[bool, ...] | None = None

    def outputs(self) -> list[int]:
        """Batch indices that get logits."""
        n = len(self.token)
        return [i for i in range(n) if (self.logits[i] if self.logits is not None else i == n - 1)]


@dataclass(frozen=True)
class SeqRm:
    seq_id: int
    p0: int
    p1: int


@dataclass(frozen=True)
class SeqCp:
    seq_id_src: int
    seq_id_dst: int
    p0: int
    p1: int


@dataclass(frozen=True)
class SeqKeep:
    seq_id: int


@dataclass(frozen=True)
class SeqAdd:
    seq_id: int
    p0: int
    p1: int
    shift: int


@dataclass(frozen=True)
class SeqDiv:
    seq_id: int
    p0: int
    p1: int
    d: int


@dataclass(frozen=True)
class Clear:
    pass


@dataclass(frozen=True)
class ContextShift:
    """``seq_rm(seq, n_keep, n_keep + n_discard)`` then ``seq_add(seq, n_keep + n_discard, -1,
    -n_discard)`` (llama.cpp's examples' context shift)."""

    seq_id: int
    n_keep: int
    n_discard: int


Step = Decode | SeqRm | SeqCp | SeqKeep | SeqAdd | SeqDiv | Clear | ContextShift


@dataclass(frozen=True)
class Scenario:
    name: str
    steps: tuple[Step, ...]
    model: str = "two_layer"
    n_ctx: int = 256
    n_batch: int = 256
    n_ubatch: int = 256
    n_seq_max: int = 1
    kv_unified: bool = True
    swa_full: bool = True

    def context_kwargs(self) -> dict:
        """The context parameters, as both contexts take them."""
        return dict(
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            n_seq_max=self.n_seq_max,
            kv_unified=self.kv_unified,
            swa_full=self.swa_full,
        )


@dataclass
class Observation:
    """What one step showed: ``rc`` and ``logits`` (n_outputs, n_vocab) for a decode that
    returned 0, ``value`` for ``seq_rm``, ``pos`` = ((pos_min, pos_max) per seq) after it."""

    step: Step
    rc: int | None = None
    logits: np.ndarray | None = None
    value: bool | None = None
    pos: tuple[tuple[int, int], ...] = field(default_factory=tuple)


# ---------------------------------------------------------------------------------------------
# Running


def _batch_for(ctx, step: Decode):
    """The step itself for llama.cpp (duck-typed fields); a ``reference.batch.Batch`` else."""
    from llamaref.llamacpp import LlamaCppContext

    if isinstance(ctx, LlamaCppContext):
        return step
    from reference.batch import Batch

    return Batch(
        token=list(step.token),
        pos=None if step.pos is None else list(step.pos),
        seq_id=None if step.seq_id is None else [list(s) for s in step.seq_id],
        logits=None if step.logits is None else list(step.logits),
    )


def apply_step(ctx, step: Step, obs: Observation) -> None:
    """Play one step on ``ctx`` and fill ``obs`` (rc, logits, value)."""
    mem = ctx.memory
    if isinstance(step, Decode):
        obs.rc = ctx.decode(_batch_for(ctx, step))
        if obs.rc == 0:
            rows = [np.asarray(ctx.get_logits_ith(i), dtype=np.float32) for i in step.outputs()]
            obs.logits = np.stack(rows)  # (n_outputs, n_vocab)
    elif isinstance(step, SeqRm):
        obs.value = bool(mem.seq_rm(step.seq_id, step.p0, step.p1))
    elif isinstance(step, SeqCp):
        mem.seq_cp(step.seq_id_src, step.seq_id_dst, step.p0, step.p1)
    elif isinstance(step, SeqKeep):
        mem.seq_keep(step.seq_id)
    elif isinstance(step, SeqAdd):
        mem.seq_add(step.seq_id, step.p0, step.p1, step.shift)
    elif isinstance(step, SeqDiv):
        mem.seq_div(step.seq_id, step.p0, step.p1, step.d)
    elif isinstance(step, Clear):
        mem.clear()
    elif isinstance(step, ContextShift):
        end = step.n_keep + step.n_discard
        obs.value = bool(mem.seq_rm(step.seq_id, step.n_keep, end))
        mem.seq_add(step.seq_id, end, -1, -step.n_discard)
    else:
        raise TypeError(f"unknown step {step!r}")


def run(scenario: Scenario, ctx) -> list[Observation]:
    """Play ``scenario`` on ``ctx``; one :class:`Observation` per step."""
    out = []
    for step in scenario.steps:
        obs = Observation(step)
        apply_step(ctx, step, obs)
        mem = ctx.memory
        obs.pos = tuple((mem.seq_pos_min(s), mem.seq_pos_max(s)) for s in range(scenario.n_seq_max))
        out.append(obs)
    return out


def decode_logits(observations: list[Observation]) -> list[np.ndarray]:
    """The logits of every successful decode, in order."""
    return [o.logits for o in observations if o.logits is not None]


def compare_observations(
    ref: list[Observation], out: list[Observation], max_nmse: float = 1e-6
) -> list[str]:
    """Differences between two runs of one scenario (empty: they agree)."""
    from tests.support.tiny_models import nmse

    problems = []
    if len(ref) != len(out):
        return [f"{len(ref)} observations vs {len(out)}"]
    for k, (a, b) in enumerate(zip(ref, out, strict=True)):
        where = f"step {k} {a.step!r}"
        if (a.rc, a.value, a.pos) != (b.rc, b.value, b.pos):
            problems.append(
                f"{where}: rc/value/pos {(a.rc, a.value, a.pos)} vs {(b.rc, b.value, b.pos)}"
            )
        if (a.logits is None) != (b.logits is None):
            problems.append(f"{where}: logits present in one run only")
        elif a.logits is not None:
            if a.logits.shape != b.logits.shape:
                problems.append(f"{where}: logits shape {a.logits.shape} vs {b.logits.shape}")
            elif (e := nmse(a.logits, b.logits)) > max_nmse:
                problems.append(f"{where}: logits NMSE {e:.3g} > {max_nmse:g}")
    return problems


# ---------------------------------------------------------------------------------------------
# The scenarios


def interleave(seqs: list[tuple[int, ...]], start: list[int] | None = None) -> Decode:
    """One batch with the sequences' tokens interleaved (k-th token of each seq, then k+1...),
    explicit positions from ``start`` (default 0), every token an output."""
    start = start or [0] * len(seqs)
    token, pos, seq_id = [], [], []
    for k in range(max(len(t) for t in seqs)):
        for s, t in enumerate(seqs):
            if k < len(t):
                token.append(t[k])
                pos.append(start[s] + k)
                seq_id.append((s,))
    return Decode(tuple(token), tuple(pos), tuple(seq_id), (True,) * len(token))


def all_logits(token, pos=None, seq=0) -> Decode:
    """A single-sequence batch with every token an output."""
    seq_id = None if seq == 0 else ((seq,),) * len(token)
    return Decode(tuple(token), None if pos is None else tuple(pos), seq_id, (True,) * len(token))


A, B, C, D = toks(10, 9), toks(11, 7), toks(12, 5), toks(13, 6)  # four prompts
A2, B2, C2, D2 = toks(20, 3), toks(21, 2), toks(22, 4), toks(23, 3)  # their continuations


def multi_seq(kv_unified: bool = True, n_seqs: int = 3, n_ubatch: int = 256) -> Scenario:
    """``n_seqs`` prompts interleaved in one batch, then their continuations in another."""
    prompts, conts = [A, B, C, D][:n_seqs], [A2, B2, C2, D2][:n_seqs]
    return Scenario(
        f"multi_seq_{n_seqs}_{'unified' if kv_unified else 'streams'}_ub{n_ubatch}",
        (interleave(prompts), interleave(conts, [len(p) for p in prompts])),
        n_ctx=256 if kv_unified else 256 * 4,
        n_ubatch=n_ubatch,
        n_seq_max=4 if not kv_unified else n_seqs,
        kv_unified=kv_unified,
    )


def seq_cp_diverge(kv_unified: bool = True) -> Scenario:
    """Prefix in seq 0, copied to seq 1, two continuations in one batch, keep seq 1, go on."""
    return Scenario(
        f"seq_cp_diverge_{'unified' if kv_unified else 'streams'}",
        (
            all_logits(A),
            SeqCp(0, 1, -1, -1),
            interleave([B2, C2], [len(A), len(A)]),
            SeqKeep(1),
            all_logits(D2, seq=1),
        ),
        n_ctx=256 * (1 if kv_unified else 2),
        n_seq_max=2,
        kv_unified=kv_unified,
    )


SEQ_RM_PARTIAL = Scenario(
    "seq_rm_partial",
    (all_logits(A), SeqRm(0, 5, -1), all_logits(B), SeqRm(0, 2, 4), all_logits(C)),
)

CONTEXT_SHIFT = Scenario(  # one layer: the shifted cache equals a fresh decode's
    "context_shift",
    (all_logits(A + B), ContextShift(0, n_keep=3, n_discard=5), all_logits(C)),
    model="one_layer",
)
CONTEXT_SHIFT_FRESH = Scenario(  # the same cache contents, decoded fresh at positions 0..
    "context_shift_fresh",
    (all_logits((A + B)[:3] + (A + B)[8:]), all_logits(C)),
    model="one_layer",
)

SEQ_ADD = Scenario(
    "seq_add",
    (all_logits(A), SeqAdd(0, 0, -1, 7), all_logits(B)),
    model="one_layer",
)
SEQ_ADD_FRESH = Scenario(
    "seq_add_fresh",
    (all_logits(A, pos=range(7, 7 + len(A))), all_logits(B)),
    model="one_layer",
)

SEQ_DIV = Scenario(  # llama.cpp rotates K by +(p_old - p_new): its logits DIFFER from the fresh
    "seq_div",
    (all_logits(A[:8]), SeqDiv(0, 0, -1, 3), all_logits(B)),
    model="one_layer",
)
SEQ_DIV_FRESH = Scenario(
    "seq_div_fresh",
    (all_logits(A[:8], pos=[p // 3 for p in range(8)]), all_logits(B)),
    model="one_layer",
)


def small_ubatch(n_ubatch: int) -> Scenario:
    """A long single-sequence batch and a 3-sequence batch cut into ubatches of ``n_ubatch``."""
    return Scenario(
        f"small_ubatch_{n_ubatch}",
        (all_logits(A + B), Clear(), interleave([A, B, C]), interleave([A2, B2, C2], [9, 7, 5])),
        n_ubatch=n_ubatch,
        n_seq_max=3,
    )


PROMPT_NO_SLOT = toks(30, 200)
NO_SLOT = Scenario(  # 200 tokens, then 100 more do not fit in 256 cells (1st ubatch of 32 would)
    "no_slot",
    (Decode(PROMPT_NO_SLOT), Decode(toks(31, 100)), all_logits(A)),
    n_ubatch=32,
)
NO_SLOT_REFERENCE = Scenario(  # the same without the failed decode
    "no_slot_reference",
    (Decode(PROMPT_NO_SLOT), all_logits(A)),
    n_ubatch=32,
)

INVALID = Scenario(  # every bad batch returns -1 and changes nothing
    "invalid",
    (
        all_logits(A[:4]),  # seq 0 at 0..3
        Decode((1,), (4,), ((2,),)),  # seq id 2 >= n_seq_max
        Decode((1,), (6,)),  # gap: seq 0 must start at 4
        Decode((1,), (3,)),  # overlap: seq 0 must start at 4
        Decode((1, 2), (4, 6)),  # a hole inside the batch
        Decode((1, 2, 3), (4, 6, 5)),  # decreasing positions
        Decode((64,), (4,)),  # token id >= n_vocab
        Decode((-1,), (4,)),  # -1 is LLAMA_TOKEN_NULL: "neither token ids nor embeddings"
        Decode((1,), (4,), ((0, 1),)),  # seq 0 coupled to seq 1, which has diverged (empty)
        Decode((1,), (4,), ((-1,),)),  # negative seq id
        all_logits(B, pos=range(4, 4 + len(B))),  # the valid continuation
    ),
    n_seq_max=2,
)
INVALID_REFERENCE = Scenario(
    "invalid_reference",
    (all_logits(A[:4]), all_logits(B, pos=range(4, 4 + len(B)))),
    n_seq_max=2,
)

CLEAR = Scenario("clear", (all_logits(A), Clear(), all_logits(B)))
AUTO_POSITIONS = Scenario(  # pos=None: each token continues its first seq id
    "auto_positions",
    (
        interleave([A, B]),
        Decode(A2 + B2, None, ((0,),) * len(A2) + ((1,),) * len(B2), (True,) * 5),
    ),
    n_seq_max=2,
)

SCENARIOS = {
    s.name: s
    for s in (
        multi_seq(True, 3),
        multi_seq(False, 4),
        multi_seq(True, 3, n_ubatch=3),
        seq_cp_diverge(True),
        seq_cp_diverge(False),
        SEQ_RM_PARTIAL,
        CONTEXT_SHIFT,
        CONTEXT_SHIFT_FRESH,
        SEQ_ADD,
        SEQ_ADD_FRESH,
        SEQ_DIV,
        SEQ_DIV_FRESH,
        small_ubatch(1),
        small_ubatch(3),
        NO_SLOT,
        NO_SLOT_REFERENCE,
        INVALID,
        INVALID_REFERENCE,
        CLEAR,
        AUTO_POSITIONS,
    )
}


# ---------------------------------------------------------------------------------------------
# Mamba and Mamba-2: the same scenarios on the recurrent memory (one cell per sequence)


MAMBA_MODELS = {  # name -> tiny_mamba_hparams kwargs (random_mamba_weights seed 1)
    "mamba": dict(arch="mamba", n_vocab=64, n_embd=16, n_layer=2, d_state=8),
    "mamba2": dict(arch="mamba2", n_vocab=64, n_embd=16, n_layer=2, d_state=8, head_dim=8,
                   n_group=2),
}


def tiny_mamba_model(name: str, dtype=np.float32):
    """``(hparams, weights)`` of the tiny Mamba model ``name`` (a key of :data:`MAMBA_MODELS`)."""
    from tests.support.tiny_models import random_mamba_weights, tiny_mamba_hparams

    hp = tiny_mamba_hparams(**MAMBA_MODELS[name])
    return hp, random_mamba_weights(hp, seed=1, dtype=dtype)


def mamba_scenarios(model: str) -> dict[str, Scenario]:
    """The recurrent-memory scenarios on ``model`` (``"mamba"`` or ``"mamba2"``), 3 sequences.

    - ``multi_seq_ub*``: three prompts interleaved in one batch, then their continuations,
      for several ``n_ubatch`` (``split_equal`` gives sets of equal length);
    - ``seq_cp``: a prefix, shared with two sequences by ``seq_cp``; a token of two coupled
      sequences returns 1 (``split_equal(sequential=True)`` cannot split coupled sequences:
      no recurrent model decodes them) and changes nothing; three divergent continuations in
      one batch, ``seq_keep``, go on;
    - ``seq_rm``: removing a whole sequence (True) and decoding it again; a partial removal
      at the end (False, nothing changes); ranges that miss the last position (True, no-op);
    - ``invalid``: bad batches return -1 and change nothing, then the valid continuation;
    - ``clear``: clear then decode equals a fresh decode.
    """
    def sc(name, steps, **kw):
        kw.setdefault("n_seq_max", 3)
        return Scenario(f"{model}_{name}", tuple(steps), model=model, **kw)

    out = [
        sc(f"multi_seq_ub{n_ubatch}",
           (interleave([A, B, C]), interleave([A2, B2, C2], [len(A), len(B), len(C)])),
           n_ubatch=n_ubatch)
        for n_ubatch in (256, 4, 2, 1)
    ]
    n = len(A)
    out.append(sc("seq_cp", (
        all_logits(A),
        SeqCp(0, 1, -1, -1),
        SeqCp(0, 2, 3, 5),  # the range is ignored: the whole state is shared
        Decode((7,), (n,), ((0, 1),), (True,)),  # coupled sequences: no split, rc 1
        interleave([B2, C2, D2], [n, n, n]),  # three divergent continuations
        SeqKeep(1),
        all_logits(D2, seq=1),
    )))
    out.append(sc("seq_rm", (
        interleave([A, B]),
        SeqRm(1, -1, -1),  # the whole sequence: True, it is empty
        all_logits(C, seq=1),  # seq 1 starts again from a zero state
        SeqRm(0, 5, -1),  # the last tokens but not all: False, nothing changes
        SeqRm(0, 0, 5),  # misses the last position: True, nothing to remove
        SeqRm(0, n, -1),  # after the last position: True, no change
        SeqRm(2, -1, -1),  # an empty sequence: True
        all_logits(A2, seq=0),
        SeqRm(0, 0, -1),  # everything: True
        all_logits(B2, seq=0),
    )))
    out.append(sc("invalid", (
        all_logits(A[:4]),
        Decode((1,), (4,), ((3,),)),  # seq id 3 >= n_seq_max
        Decode((1,), (6,)),  # gap
        Decode((1,), (3,)),  # overlap: a state cannot rewind
        Decode((1, 2), (4, 6)),  # a hole
        Decode((64,), (4,)),  # token id >= n_vocab
        Decode((1,), (4,), ((0, 1),)),  # coupled to seq 1, which is empty
        all_logits(B, pos=range(4, 4 + len(B))),
    )))
    out.append(sc("clear", (all_logits(A), Clear(), all_logits(B))))
    return {s.name: s for s in out}


MAMBA_SCENARIOS = {**mamba_scenarios("mamba"), **mamba_scenarios("mamba2")}
