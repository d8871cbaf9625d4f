"""Draw a multi-sequence KV cache's cells and a KQ mask: ``docs/assets/figures/kv_cells.svg``.

Run from anywhere, after changing ``reference/memory/`` or the mask::

    python docs/figures/kv_cells.py

and commit the SVG (the docs build runs this too, through ``docs/figures/hook.py``). Nothing
in the picture is typed by hand: a real ``Context`` on a tiny sliding-window model
(``tiny_hparams(n_swa=N_SWA)``, three sequences, one unified stream) runs the ``STEPS``
below (decodes, a ``seq_cp`` that shares a prefix, a ``seq_rm`` that leaves a hole), and the
picture shows its cells before and after the last decode and the KQ mask that decode
computed, recorded from the memory's ``graph_input``. The cells a token could see without
the window (``set_input_kq_mask`` again, with no window) but does not see with it are
hatched: those are what sliding-window attention hides.
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
from reference.testing import random_weights, tiny_hparams  # noqa: E402

OUT = sf.OUT_DIR / "kv_cells.svg"
N_SWA = 4  # the window: a token at position p sees p - 3 .. p
N_SHOWN = 16  # cells drawn; the rest of n_kv is empty and masked


def tokens(*runs: tuple[int, int, int]) -> Batch:
    """A batch of runs ``(seq_id, first pos, last pos)``, token ids made up."""
    seq = [s for s, p0, p1 in runs for _ in range(p0, p1 + 1)]
    pos = [p for _, p0, p1 in runs for p in range(p0, p1 + 1)]
    return Batch(token=[1 + i for i in range(len(pos))], pos=pos, seq_id=[[s] for s in seq],
                 logits=[True] * len(pos))


# What happens to the cache, in order: ("decode", runs) or (memory op, args). The last step
# is the decode whose ubatch the picture shows.
STEPS = [
    ("decode", ((0, 0, 5),)),
    ("seq_cp", (0, 1, -1, -1)),
    ("decode", ((0, 6, 6), (1, 6, 6), (2, 0, 4))),
    ("seq_rm", (2, 1, -1)),
    ("decode", ((0, 7, 8), (1, 7, 7), (2, 1, 2))),
]


def describe(step) -> str:
    """One line for a step: ``decode seq 0 pos 7-8, ...`` or ``seq_cp(0, 1, -1, -1)``."""
    op, args = step
    if op != "decode":
        return f"{op}{args}"
    runs = [f"seq {s} pos {p0}" + (f"\u2013{p1}" if p1 > p0 else "") for s, p0, p1 in args]
    return "decode " + ", ".join(runs)


def run() -> dict:
    """Run ``STEPS`` on a real Context; the cells before and after the last decode, its mask."""
    hp = tiny_hparams(n_swa=N_SWA)
    ctx = Context(hp, random_weights(hp), n_ctx=256, n_seq_max=3)
    memory = ctx.memory  # every layer is SWA: an iSWA pair whose SWA cache holds them all
    cache = memory.get_swa()  # the cells drawn
    recorded = []
    graph_input = memory.graph_input

    def record(placement, ubatch):  # what the forward of each ubatch is given
        inp = graph_input(placement, ubatch)
        recorded.append((ubatch, inp.swa))
        return inp

    memory.graph_input = record
    for k, (op, args) in enumerate(STEPS):
        if k == len(STEPS) - 1:
            before = cache.v_cells[0].copy()
            recorded.clear()
        if op == "decode":
            assert ctx.decode(tokens(*args)) == 0, ctx.last_error
        else:
            getattr(memory, op)(*args)
    [(ubatch, inp)] = recorded  # the last decode is one ubatch
    cells = cache.v_cells[0]
    no_window = set_input_kq_mask(cache.v_cells, cache.seq_to_stream, ubatch.pos,
                                  ubatch.seq_id, inp.sinfo.strm, inp.n_kv, 0, SWA_TYPE_NONE)
    assert cells.used_max_p1() <= N_SHOWN < inp.n_kv
    assert not (inp.kq_mask[:, N_SHOWN:] == 0).any()  # nothing visible beyond the drawn cells
    assert ((inp.kq_mask == 0) <= (no_window == 0)).all()  # the window only hides
    return {"hp": hp, "before": before, "after": cells, "ubatch": ubatch,
            "slot": inp.sinfo.idxs[0], "mask": inp.kq_mask, "no_window": no_window,
            "n_kv": inp.n_kv, "swa_type": cache.swa_type}


CW = 0.355  # inches per cell column
X0 = 8.0 - 0.2 - N_SHOWN * CW  # the first cell column
ROW = 0.36  # a row of cells
MROW = 0.3  # a row of the mask


def draw_cells(ax, cells, y: float, slot=()) -> None:
    """One row of cells: each a square striped by its sequences, its position inside."""
    for i in range(N_SHOWN):
        sf.kv_cell(ax, cells, i, X0 + i * CW, y, CW, ROW, i in slot, sf.TEXT)


def draw(out: Path = OUT) -> Path:
    """Run the steps, draw the picture and write it as SVG to ``out``."""
    r = run()
    ub, mask, no_window = r["ubatch"], r["mask"], r["no_window"]
    n_tokens = len(ub.pos)
    history = [f"{k + 1}. {describe(step)}" for k, step in enumerate(STEPS)]
    height = 0.2 + 0.22 * len(history) + 0.25 + 0.3 + 2 * (ROW + 0.2) + 0.45 \
        + n_tokens * MROW + 0.25 + 0.75
    with sf.style() as plt:
        fig, ax = sf.canvas(plt, height)
        y = height - 0.25
        ax.text(0.15, y, f"tiny_hparams(n_swa={N_SWA}): every layer sees a window of "
                f"{N_SWA} positions; one stream of cells, three sequences",
                fontsize=sf.TEXT, color=sf.INK, va="center")
        for line in history:
            y -= 0.22
            ax.text(0.3, y, line, family=sf.MONO, fontsize=sf.SMALL + 0.5, color=sf.INK,
                    va="center")

        # cell indices, then the cells before and after the drawn decode
        y -= 0.4
        ax.text(X0 - 0.12, y, "cell", ha="right", va="center", fontsize=sf.SMALL,
                color=sf.GREY)
        for i in range(N_SHOWN):
            ax.text(X0 + (i + 0.5) * CW, y, str(i), ha="center", va="center",
                    fontsize=sf.SMALL, color=sf.GREY)
        y -= 0.15 + ROW
        draw_cells(ax, r["before"], y)
        ax.text(X0 - 0.12, y + ROW / 2, f"pos before step {len(STEPS)}", ha="right",
                va="center", fontsize=sf.TEXT, color=sf.INK)
        y -= 0.2 + ROW
        draw_cells(ax, r["after"], y, slot=set(r["slot"]))
        ax.text(X0 - 0.12, y + ROW / 2, f"pos after step {len(STEPS)}", ha="right",
                va="center", fontsize=sf.TEXT, color=sf.INK)

        # the mask: a row per token of the ubatch, a column per cell
        y -= 0.38
        ax.text(X0, y, f"KQ mask of step {len(STEPS)}: {n_tokens} tokens \u00d7 n_kv = "
                f"{r['n_kv']} cells (cells {N_SHOWN}\u2013{r['n_kv'] - 1} are empty: "
                f"\u2212inf)", fontsize=sf.SMALL + 0.5, color=sf.INK, va="center")
        y -= 0.12
        for t in range(n_tokens):
            s, p = ub.seq_id[t][0], int(ub.pos[t])
            y -= MROW
            ax.text(X0 - 0.12, y + MROW / 2, f"seq {s}, pos {p}", ha="right", va="center",
                    fontsize=sf.TEXT, color=sf.SEQ_EDGE[s], fontweight="bold")
            for i in range(N_SHOWN):
                x = X0 + i * CW + 0.02
                if mask[t, i] == 0:
                    sf.rect(ax, x, y + 0.02, CW - 0.04, MROW - 0.04, fill=sf.SEQ_EDGE[s],
                            edge="none", lw=0)
                elif no_window[t, i] == 0:  # visible but for the window
                    sf.rect(ax, x, y + 0.02, CW - 0.04, MROW - 0.04, fill="white",
                            edge=sf.SEQ_EDGE[s], lw=0.8, hatch="////")
                else:
                    sf.rect(ax, x, y + 0.02, CW - 0.04, MROW - 0.04, fill="#f4f4f4",
                            edge="#dddddd", lw=0.6)

        # the legend
        y -= 0.42
        x = 0.15
        for s in range(3):
            sf.rect(ax, x, y - 0.1, 0.28, 0.2, fill=sf.SEQ_FILL[s], edge="#888888")
            ax.text(x + 0.36, y, f"seq {s}", va="center", fontsize=sf.SMALL, color=sf.INK)
            x += 0.95
        sf.rect(ax, x, y - 0.1, 0.14, 0.2, fill=sf.SEQ_FILL[0], edge="none", lw=0)
        sf.rect(ax, x + 0.14, y - 0.1, 0.14, 0.2, fill=sf.SEQ_FILL[1], edge="none", lw=0)
        sf.rect(ax, x, y - 0.1, 0.28, 0.2, fill="none", edge="#888888")
        ax.text(x + 0.36, y, "seq 0 and 1 (seq_cp)", va="center", fontsize=sf.SMALL,
                color=sf.INK)
        x += 0.55 + sf.text_width(ax, "seq 0 and 1 (seq_cp)", fontsize=sf.SMALL)
        sf.rect(ax, x, y - 0.1, 0.28, 0.2, fill="white", edge="#111111", lw=2.0)
        ax.text(x + 0.36, y, "written by step " + str(len(STEPS)), va="center",
                fontsize=sf.SMALL, color=sf.INK)
        y -= 0.32
        sf.mask_legend(ax, y, N_SWA)
        return sf.save(plt, fig, out, "kv_cells.py")


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
