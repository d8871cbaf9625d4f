"""Draw the two caches of an iSWA memory and their KQ masks: ``docs/assets/figures/iswa.svg``.

Run from anywhere, after changing ``reference/memory/`` or the mask::

    python docs/figures/iswa.py

and commit the SVG (the docs build runs this too, through ``docs/figures/hook.py``). Nothing
in the picture is typed by hand: a real ``Context`` on a tiny Gemma 2 model
(``tiny_gemma_hparams("gemma2", n_swa=N_SWA)``: layer 0 SWA, layer 1 full, the 1:1 pattern)
with ``swa_full=False`` gets the iSWA memory (``create_memory``): a base cache of 512 cells
and a SWA cache of 256. Two sequences decode ``STEPS``; the last decode goes past the SWA
cache's end, so the SWA cache reuses cells whose positions the window already hides while
the base cache keeps every position. The picture shows both caches' cells (the first and the
last used ones) and the KQ mask each computed for the last ubatch, recorded from the memory's
``graph_input``. The cells a token could see without the window (``set_input_kq_mask`` with no
window) but does not see with it are hatched.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # svgfig, beside this file
    sys.path.insert(0, HERE)

import svgfig as sf  # noqa: E402

from reference.batch import Batch  # noqa: E402
from reference.context import Context  # noqa: E402
from reference.hparams import SWA_TYPE_NONE  # noqa: E402
from reference.memory.kq_mask import set_input_kq_mask  # noqa: E402
from reference.testing import random_gemma_weights, tiny_gemma_hparams  # noqa: E402

OUT = sf.OUT_DIR / "iswa.svg"
N_SWA = 4  # the window: a token at position p sees p - 3 .. p on the SWA layer
N_HEAD = 6  # cells drawn from the start of each cache
N_TAIL = 8  # cells drawn before the end of the used range

# (seq_id, first pos, last pos): the runs of each decode, in batch order. Step 1 interleaves
# the two sequences token by token; step 2 is the ubatch the picture shows.
STEPS = [
    ("interleaved", ((0, 0, 126), (1, 0, 126))),
    ("runs", ((0, 127, 128), (1, 127, 128))),
]


def batch(kind: str, runs) -> Batch:
    """The batch of a step: runs one after the other, or their tokens interleaved."""
    items = [(s, p) for s, p0, p1 in runs for p in range(p0, p1 + 1)]
    if kind == "interleaved":
        items = sorted(items, key=lambda sp: (sp[1], sp[0]))
    return Batch(token=[1 + (7 * i) % 31 for i in range(len(items))], pos=[p for _, p in items],
                 seq_id=[[s] for s, _ in items], logits=[True] * len(items))


def describe(kind: str, runs) -> str:
    """One line for a step: ``decode seq 0 pos 127-128, seq 1 pos 127-128``."""
    parts = [f"seq {s} pos {p0}\u2013{p1}" for s, p0, p1 in runs]
    return "decode " + (" and ".join(parts) + ", interleaved" if kind == "interleaved"
                        else ", ".join(parts))


def run() -> dict:
    """Run ``STEPS`` on a real Context; both caches after the last decode and its two masks."""
    hp = tiny_gemma_hparams("gemma2", n_swa=N_SWA)
    ctx = Context(hp, random_gemma_weights(hp), n_ctx=512, n_ubatch=64, n_seq_max=2,
                  swa_full=False)
    memory = ctx.memory
    recorded = []
    graph_input = memory.graph_input

    def record(placement, ubatch):  # what the forward of each ubatch is given
        inp = graph_input(placement, ubatch)
        recorded.append((ubatch, inp))
        return inp

    memory.graph_input = record
    for k, (kind, runs) in enumerate(STEPS):
        if k == len(STEPS) - 1:
            recorded.clear()
        assert ctx.decode(batch(kind, runs)) == 0, ctx.last_error
    [(ubatch, inp)] = recorded  # the last decode is one ubatch
    caches = {}
    for name, cache, part in (("base", memory.kv_base, inp.base), ("swa", memory.kv_swa, inp.swa)):
        cells = cache.v_cells[0]
        used = cells.used_max_p1()
        shown = list(range(N_HEAD)) + list(range(used - N_TAIL, used))
        no_window = set_input_kq_mask(cache.v_cells, cache.seq_to_stream, ubatch.pos,
                                      ubatch.seq_id, part.sinfo.strm, part.n_kv, 0,
                                      SWA_TYPE_NONE)
        assert ((part.kq_mask == 0) <= (no_window == 0)).all()  # the window only hides
        assert not (part.kq_mask[:, used:] == 0).any()  # nothing visible past the used cells
        caches[name] = {"cache": cache, "cells": cells, "shown": shown, "used": used,
                        "mask": part.kq_mask, "no_window": no_window, "n_kv": part.n_kv,
                        "slot": set(part.sinfo.idxs[0])}
    # the layers each cache serves, as the graph input dispatches them
    for il in range(hp.n_layer):
        assert inp.layer_input(il) is (inp.swa if hp.is_swa(il) else inp.base)
    # the SWA cache holds what its window needs: every visible cell is drawn
    swa = caches["swa"]
    assert set((swa["mask"] == 0).any(axis=0).nonzero()[0]) <= set(swa["shown"])
    return {"hp": hp, "ctx": ctx, "memory": memory, "ubatch": ubatch, "caches": caches}


CW = 0.355  # inches per cell column
GAP = 0.45  # the column of the cells not drawn
ROW = 0.36  # a row of cells
MROW = 0.3  # a row of the mask
X0 = 8.0 - 0.2 - (N_HEAD + N_TAIL) * CW - GAP  # the first cell column


def col_x(k: int) -> float:
    """x of the ``k``-th drawn column (the gap sits after the first ``N_HEAD``)."""
    return X0 + k * CW + (GAP if k >= N_HEAD else 0.0)


def draw_cells(ax, cells, shown, y: float, slot) -> None:
    """One row of cells: each a square coloured by its sequence, its position inside."""
    for k, i in enumerate(shown):
        sf.kv_cell(ax, cells, i, col_x(k), y, CW, ROW, i in slot, sf.SMALL)
    ax.text(X0 + N_HEAD * CW + GAP / 2, y + ROW / 2, "\u2026", ha="center", va="center",
            fontsize=sf.TEXT, color=sf.GREY)


def mask_cell(ax, x: float, y: float, w: float, seen: bool, windowed: bool, s: int) -> None:
    """One entry of a mask: seen (0), hidden by the window only (hatched), or hidden."""
    if seen:
        sf.rect(ax, x, y + 0.02, w, MROW - 0.04, fill=sf.SEQ_EDGE[s], edge="none", lw=0)
    elif windowed:
        sf.rect(ax, x, y + 0.02, w, MROW - 0.04, fill="white", edge=sf.SEQ_EDGE[s], lw=0.8,
                hatch="////")
    else:
        sf.rect(ax, x, y + 0.02, w, MROW - 0.04, fill="#f4f4f4", edge="#dddddd", lw=0.6)


def draw_cache(ax, y: float, title: str, c: dict, ub) -> float:
    """A cache: its title, cell indices, cells, and the last ubatch's mask; the y below it."""
    ax.text(0.15, y, title, fontsize=sf.TEXT, color=sf.INK, va="center", fontweight="bold")
    y -= 0.32
    ax.text(X0 - 0.12, y, "cell", ha="right", va="center", fontsize=sf.SMALL, color=sf.GREY)
    for k, i in enumerate(c["shown"]):
        ax.text(col_x(k) + CW / 2, y, str(i), ha="center", va="center", fontsize=sf.SMALL - 1,
                color=sf.GREY)
    y -= 0.15 + ROW
    draw_cells(ax, c["cells"], c["shown"], y, c["slot"])
    ax.text(X0 - 0.12, y + ROW / 2, "pos", ha="right", va="center", fontsize=sf.TEXT,
            color=sf.INK)
    y -= 0.1
    hidden = list(range(N_HEAD, c["used"] - N_TAIL))  # the cells of the gap
    for t in range(len(ub.pos)):
        s, p = ub.seq_id[t][0], int(ub.pos[t])
        y -= MROW
        ax.text(X0 - 0.12, y + MROW / 2, f"seq {s}, pos {p}", ha="right", va="center",
                fontsize=sf.TEXT, color=sf.SEQ_EDGE[s], fontweight="bold")
        for k, i in enumerate(c["shown"]):
            mask_cell(ax, col_x(k) + 0.02, y, CW - 0.04, c["mask"][t, i] == 0,
                      c["no_window"][t, i] == 0, s)
        # the gap: what the cells not drawn are for this token, summed up
        seen = bool((c["mask"][t, hidden] == 0).any())
        windowed = bool((c["no_window"][t, hidden] == 0).any())
        mask_cell(ax, X0 + N_HEAD * CW + 0.06, y, GAP - 0.12, seen, windowed, s)
    return y


def draw(out: Path = OUT) -> Path:
    """Run the steps, draw the picture and write it as SVG to ``out``."""
    r = run()
    memory, ub, caches = r["memory"], r["ubatch"], r["caches"]
    base, swa = caches["base"], caches["swa"]
    n_tokens = len(ub.pos)
    layers = {name: ", ".join(map(str, c["cache"].layers)) for name, c in caches.items()}
    history = [f"{k + 1}. {describe(kind, runs)}" for k, (kind, runs) in enumerate(STEPS)]
    block = 0.32 + 0.15 + ROW + 0.1 + n_tokens * MROW
    height = 0.25 + 0.24 + 0.22 * (len(history) + 1) + 0.45 + 2 * block + 0.8 + 0.45 \
        + 0.64 + 0.2
    with sf.style() as plt:
        fig, ax = sf.canvas(plt, height)
        y = height - 0.25
        ax.text(0.15, y, f"tiny_gemma_hparams(\"gemma2\", n_swa={N_SWA}): layer "
                f"{layers['swa']} SWA, layer {layers['base']} full (the 1:1 pattern)",
                fontsize=sf.TEXT, color=sf.INK, va="center")
        y -= 0.24
        ax.text(0.15, y, f"Context(n_ctx=512, n_ubatch=64, n_seq_max=2, swa_full=False): "
                f"create_memory gives a {type(memory).__name__}", fontsize=sf.TEXT,
                color=sf.INK, va="center")
        for line in history:
            y -= 0.22
            ax.text(0.3, y, line, family=sf.MONO, fontsize=sf.SMALL + 0.5, color=sf.INK,
                    va="center")
        y -= 0.22
        pos_min = [(memory.seq_pos_min(s), base["cache"].seq_pos_min(s)) for s in (0, 1)]
        ax.text(0.3, y, "after step 2: seq_pos_min = " + ", ".join(
            f"{a} (seq {s}; the base cache still has {b})" for s, (a, b) in enumerate(pos_min)),
            fontsize=sf.SMALL + 0.5, color=sf.INK, va="center")

        y -= 0.45
        y = draw_cache(ax, y, f"base cache: {base['cache'].get_size()} cells, layer "
                       f"{layers['base']}, no window; KQ mask of step 2: {n_tokens} tokens "
                       f"\u00d7 n_kv = {base['n_kv']}", base, ub)
        y -= 0.5
        y = draw_cache(ax, y, f"SWA cache: {swa['cache'].get_size()} cells, layer "
                       f"{layers['swa']}, n_swa = {swa['cache'].n_swa}; KQ mask of step 2: "
                       f"{n_tokens} tokens \u00d7 n_kv = {swa['n_kv']}", swa, ub)

        # the legend
        y -= 0.45
        x = 0.15
        for s in range(2):
            sf.rect(ax, x, y - 0.1, 0.28, 0.2, fill=sf.SEQ_FILL[s], edge="#888888")
            ax.text(x + 0.36, y, f"seq {s}", va="center", fontsize=sf.SMALL, color=sf.INK)
            x += 0.95
        sf.rect(ax, x, y - 0.1, 0.28, 0.2, fill="white", edge="#111111", lw=2.0)
        ax.text(x + 0.36, y, "written by step 2", va="center", fontsize=sf.SMALL,
                color=sf.INK)
        y -= 0.32
        sf.mask_legend(ax, y, N_SWA)
        y -= 0.32
        ax.text(0.15 + 0.14, y, "\u2026", ha="center", va="center", fontsize=sf.TEXT,
                color=sf.GREY)
        ax.text(0.15 + 0.36, y, "the cells not drawn; in a mask row: seen if any of them is, "
                "else hatched if any is hidden by the window only",
                va="center", fontsize=sf.SMALL, color=sf.INK)
        return sf.save(plt, fig, out, "iswa.py")


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
