"""Draw how the three splits cut one batch into ubatches: ``docs/assets/figures/ubatch_splits.svg``.

Run from anywhere, after changing the splits of ``reference/batch.py``::

    python docs/figures/ubatch_splits.py

and commit the SVG (the docs build runs this too, through ``docs/figures/hook.py``). The
batch is ``BATCH``: three sequences, a two-token prefix shared by sequences 0 and 1 (one
token in two sequences), then the sequences interleaved. Each row of the picture is a fresh
``BatchAllocr`` of that batch cut by one split, called until it returns an empty ubatch, as
the memories call them; the ubatches are drawn in the order they come out, their tokens in
ubatch order. When a split gives up with tokens left (``split_equal(sequential=True)``
with a token in two sequences), the row says why, in the allocator's own words.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # svgfig, beside this file
    sys.path.insert(0, HERE)

import svgfig as sf  # noqa: E402

from reference.batch import Batch, BatchAllocr  # noqa: E402

OUT = sf.OUT_DIR / "ubatch_splits.svg"
N_UBATCH = 4

# (seq ids, pos) of each token, in batch order
TOKENS = [((0, 1), 0), ((0, 1), 1), ((2,), 0), ((0,), 2), ((1,), 2), ((2,), 1), ((0,), 3),
          ((1,), 3), ((2,), 2), ((0,), 4)]
BATCH = Batch(token=[10 + i for i in range(len(TOKENS))], pos=[p for _, p in TOKENS],
              seq_id=[list(s) for s, _ in TOKENS], logits=[True] * len(TOKENS))

# (split, keyword arguments, who uses it: the memory table of the batch chapter)
SPLITS = [
    ("split_simple", {}, "KV cache, one stream"),
    ("split_equal", {"sequential": False}, "iSWA fallback, hybrid memory"),
    ("split_equal", {"sequential": True}, "KV cache, stream per sequence"),
    ("split_seq", {}, "recurrent memory, embeddings"),
]


def cut(split: str, kwargs: dict) -> tuple[list, str | None]:
    """The ubatches a fresh allocator gives, and why it stopped early (None if it did not)."""
    balloc = BatchAllocr(BATCH, n_vocab=64, n_seq_max=3)
    ubatches = []
    while (ub := getattr(balloc, split)(N_UBATCH, **kwargs)).n_tokens:
        ubatches.append(ub)
    left = balloc.n_tokens - balloc.n_used
    return ubatches, (balloc.split_error or f"{left} tokens left") if left else None


BOX = 0.42  # a token
GAP = 0.32  # between two ubatches
X0 = 2.45  # the first token of a row


def token(ax, x: float, y: float, i: int, h: float = BOX) -> None:
    """Token ``i`` of the batch: a box striped by its sequences, its index inside."""
    seqs = TOKENS[i][0]
    w = (BOX - 0.06) / len(seqs)
    for k, s in enumerate(seqs):
        sf.rect(ax, x + 0.03 + k * w, y, w, h, fill=sf.SEQ_FILL[s], edge="none", lw=0)
    sf.rect(ax, x + 0.03, y, BOX - 0.06, h, fill="none", edge="#777777")
    ax.text(x + BOX / 2, y + h / 2, str(i), ha="center", va="center", fontsize=sf.TEXT,
            color=sf.INK, fontweight="bold")


def label(ax, y: float, lines: list[str], note: str) -> None:
    """A row's name (the call, in ``lines``) and, under it, what uses it."""
    y += 0.11 * (len(lines) - 1)
    for k, line in enumerate(lines):
        ax.text(X0 - 0.15, y + 0.1, line, ha="right", va="center", family=sf.MONO,
                fontsize=sf.TEXT - 0.5, color=sf.INK, fontweight="bold" if k == 0 else None)
        y -= 0.22
    ax.text(X0 - 0.15, y + 0.08, note, ha="right", va="center", fontsize=sf.SMALL,
            color=sf.GREY)


def draw(out: Path = OUT) -> Path:
    """Cut the batch with every split, draw the picture and write it as SVG to ``out``."""
    rows = [(split, kwargs, note, *cut(split, kwargs)) for split, kwargs, note in SPLITS]
    row_h = 1.0
    height = 0.35 + 1.2 + len(rows) * row_h + 0.6
    with sf.style() as plt:
        fig, ax = sf.canvas(plt, height)
        y = height - 0.3
        ax.text(0.15, y, f"n_ubatch = {N_UBATCH}; a box is a token, its number its index in "
                "the batch, its colour its sequences", fontsize=sf.TEXT, color=sf.INK,
                va="center")
        # the batch, in order, with each token's position
        y -= 0.75
        label(ax, y, ["the batch"], f"{len(TOKENS)} tokens, in batch order")
        for i, (_, pos) in enumerate(TOKENS):
            x = X0 + i * (BOX + 0.06)
            token(ax, x, y - BOX / 2, i)
            ax.text(x + BOX / 2, y - BOX / 2 - 0.14, f"pos {pos}", ha="center", va="center",
                    fontsize=sf.SMALL, color=sf.GREY)
        y -= 0.45
        ax.plot([0.15, 7.85], [y, y], color="#cccccc", lw=1.0)

        for split, kwargs, note, ubatches, stopped in rows:
            y -= row_h / 2 + 0.12
            if kwargs:  # the call on two lines: it is long
                keywords = ", ".join(f"{k}={v}" for k, v in kwargs.items())
                label(ax, y, [f"{split}({N_UBATCH},", f"{keywords})"], note)
            else:
                label(ax, y, [f"{split}({N_UBATCH})"], note)
            x = X0
            for k, ub in enumerate(ubatches):
                x_start = x
                for i in ub.idx.tolist():
                    token(ax, x, y - BOX / 2 + 0.05, i)
                    x += BOX
                ax.plot([x_start + 0.03, x - 0.03], [y + BOX / 2 + 0.1] * 2, color=sf.GREY,
                        lw=1.2)
                ax.text((x_start + x) / 2, y + BOX / 2 + 0.2, f"ubatch {k}", ha="center",
                        va="center", fontsize=sf.SMALL, color=sf.GREY)
                ax.text((x_start + x) / 2, y - BOX / 2 - 0.1,
                        f"{ub.n_seqs} \u00d7 {ub.n_seq_tokens}", ha="center", va="center",
                        fontsize=sf.SMALL, color=sf.GREY)
                x += GAP
            if stopped:
                ax.text(x, y + 0.05, f"no ubatch: {stopped}", va="center", ha="left",
                        fontsize=sf.SMALL, color="#a33", wrap=True)
            y -= row_h / 2 - 0.12

        # the legend
        y -= 0.3
        x = 0.15
        for seqs in [(0,), (1,), (2,), (0, 1)]:
            w = 0.3 / len(seqs)
            for k, s in enumerate(seqs):
                sf.rect(ax, x + k * w, y - 0.1, w, 0.2, fill=sf.SEQ_FILL[s], edge="none", lw=0)
            sf.rect(ax, x, y - 0.1, 0.3, 0.2, fill="none", edge="#777777")
            text = "seq " + " and ".join(map(str, seqs))
            ax.text(x + 0.38, y, text, va="center", fontsize=sf.SMALL, color=sf.INK)
            x += 0.6 + sf.text_width(ax, text, fontsize=sf.SMALL)
        ax.text(x + 0.2, y, "n_seqs \u00d7 n_seq_tokens under each ubatch", va="center",
                fontsize=sf.SMALL, color=sf.GREY)
        return sf.save(plt, fig, out, "ubatch_splits.py")


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
