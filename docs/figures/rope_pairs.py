"""Draw RoPE's pairs of dimensions and their turns: ``docs/assets/figures/rope_pairs.svg``.

Run from anywhere, after changing ``reference/ops/rope.py``::

    python docs/figures/rope_pairs.py

and commit the SVG (the docs build runs this too, through ``docs/figures/hook.py``). Both
halves come from the reference's functions, not from the formulas retyped:

- the pairs: ``rotate_pairs`` turns one pair ``j`` by a quarter turn (the others not at
  all) and the picture joins the two dimensions that moved (``pairs``), for the normal and
  the NeoX layout;
- the turns: ``rope_ext`` rotates the unit vector of each pair's first dimension at
  positions ``0 .. N_POS - 1``, and the picture puts each result on that pair's circle; the
  angle per position is ``rope_theta`` at position 1.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # svgfig, beside this file
    sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import svgfig as sf  # noqa: E402

from reference.ops.rope import (  # noqa: E402
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    RopeParams,
    rope_ext,
    rope_theta,
    rotate_pairs,
)

OUT = sf.OUT_DIR / "rope_pairs.svg"
N_DIMS = 8  # a head of 8 dimensions, all rotated: 4 pairs
FREQ_BASE = 10000.0  # llama's b
N_POS = 8  # positions drawn on the circles
PAIR_FILL = ["#d6e4f5", "#fbdcc4", "#d4edd4", "#eadcf2"]
PAIR_EDGE = ["#34629c", "#b86b1b", "#3f7f3c", "#7a4f99"]


def pairs(mode: int) -> list[tuple[int, int]]:
    """``(a, b)`` of each pair ``j``: the two dims a quarter turn of pair ``j`` moves.

    ``rotate_pairs`` maps ``x_a`` to ``x_b`` under a quarter turn (cos 0, sin 1).
    """
    out = []
    for j in range(N_DIMS // 2):
        cos = np.ones((1, N_DIMS // 2), np.float64)
        sin = np.zeros((1, N_DIMS // 2), np.float64)
        cos[0, j], sin[0, j] = 0.0, 1.0  # a quarter turn of pair j only
        moved = []
        for a in range(N_DIMS):
            x = np.zeros((1, 1, N_DIMS))
            x[0, 0, a] = 1.0
            y = rotate_pairs(x, cos, sin, N_DIMS, mode)[0, 0]
            if not np.allclose(y, x[0, 0]) and y[np.argmax(np.abs(y))] > 0:
                moved.append((a, int(np.argmax(y))))  # x_a went to +x_b: a is the first
        [(a, b)] = moved
        out.append((a, b))
    return out


def turns(a: int, b: int) -> np.ndarray:
    """``(N_POS, 2)``: the pair ``(x_a, x_b)`` of a unit ``x_a`` after ``rope_ext`` at each
    position ``0 .. N_POS - 1`` (normal layout)."""
    x = np.zeros((N_POS, 1, N_DIMS))
    x[:, 0, a] = 1.0
    y = rope_ext(x, np.arange(N_POS), RopeParams(N_DIMS, ROPE_TYPE_NORM, freq_base=FREQ_BASE))
    return y[:, 0, [a, b]]


def draw_layout(ax, y: float, mode_pairs: list[tuple[int, int]], name: str, note: str) -> None:
    """The head's dims as boxes, coloured by pair, each pair joined by an arc above."""
    from matplotlib.patches import Arc

    x0, w = 2.7, 0.55
    ax.text(x0 - 0.2, y + 0.12, name, ha="right", va="center", family=sf.MONO,
            fontsize=sf.TEXT - 0.5, fontweight="bold", color=sf.INK)
    ax.text(x0 - 0.2, y - 0.12, note, ha="right", va="center", fontsize=sf.SMALL,
            color=sf.GREY)
    pair_of = {d: j for j, ab in enumerate(mode_pairs) for d in ab}
    for d in range(N_DIMS):
        j = pair_of[d]
        sf.rect(ax, x0 + d * w + 0.04, y - 0.18, w - 0.08, 0.36, fill=PAIR_FILL[j],
                edge=PAIR_EDGE[j], lw=1.0)
        ax.text(x0 + (d + 0.5) * w, y, f"x{d}", ha="center", va="center", family=sf.MONO,
                fontsize=sf.TEXT, color=sf.INK)
    for j, (a, b) in enumerate(mode_pairs):
        xa, xb = x0 + (a + 0.5) * w, x0 + (b + 0.5) * w
        span = xb - xa
        rise = min(0.25 + 0.1 * span, 0.5) + 0.1 * j * (b - a > 1)  # crossing arcs: apart
        ax.add_patch(Arc(((xa + xb) / 2, y + 0.2), span, rise, theta1=0, theta2=180,
                         color=PAIR_EDGE[j], lw=1.5))


def draw(out: Path = OUT) -> Path:
    """Find the pairs, turn the vectors, draw the picture and write it as SVG to ``out``."""
    norm, neox = pairs(ROPE_TYPE_NORM), pairs(ROPE_TYPE_NEOX)
    per_pos = rope_theta(np.array([1]), N_DIMS, FREQ_BASE)[0]  # theta_j(1), (n_dims / 2,)
    height = 0.35 + 2 * 0.95 + 0.35 + 2.5 + 0.55
    with sf.style() as plt:
        fig, ax = sf.canvas(plt, height)
        y = height - 0.3
        ax.text(0.15, y, f"one head of {N_DIMS} dimensions, all rotated (n_dims = {N_DIMS}): "
                f"{N_DIMS // 2} pairs, one colour each", fontsize=sf.TEXT, color=sf.INK,
                va="center")
        y -= 0.85
        draw_layout(ax, y, norm, "ROPE_TYPE_NORM", "pair j: x[2j], x[2j+1] (GGUF llama)")
        y -= 0.95
        draw_layout(ax, y, neox, "ROPE_TYPE_NEOX",
                    f"pair j: x[j], x[j+{N_DIMS // 2}] (HF rotate_half)")

        # the circles: pair j turns by theta_j(p) = p * b^(-2j/n_dims)
        y -= 0.55
        ax.text(0.15, y, f"pair j turns by \u03b8j(p) = p \u00b7 b^(\u22122j/n_dims), "
                f"b = {FREQ_BASE:g}: positions p = 0 .. {N_POS - 1} on each pair's circle",
                fontsize=sf.TEXT, color=sf.INK, va="center")
        r = 0.72
        for j, (a, b) in enumerate(norm):
            cx, cy = 1.0 + j * 1.95, y - 0.35 - r - 0.1
            circle = plt.Circle((cx, cy), r, fill=False, color="#bbbbbb", lw=1.0)
            ax.add_patch(circle)
            ax.plot([cx - r - 0.08, cx + r + 0.08], [cy, cy], color="#dddddd", lw=0.8)
            ax.plot([cx, cx], [cy - r - 0.08, cy + r + 0.08], color="#dddddd", lw=0.8)
            pts = turns(a, b)  # (N_POS, 2)
            for p, (u, v) in enumerate(pts):
                ax.plot([cx, cx + r * u], [cy, cy + r * v], color=PAIR_EDGE[j], lw=0.8,
                        alpha=0.35 + 0.65 * p / (N_POS - 1))
                ax.plot([cx + r * u], [cy + r * v], "o", ms=4, color=PAIR_EDGE[j])
                if j == 0:  # the fast pair: every position apart, labelled
                    ax.text(cx + (r + 0.16) * u, cy + (r + 0.16) * v, str(p),
                            ha="center", va="center", fontsize=sf.SMALL, color=sf.INK)
            last = math.atan2(pts[-1][1], pts[-1][0]) % (2 * math.pi)
            ax.text(cx, cy + r + 0.22, f"pair {j}: x{a}, x{b}", ha="center", va="center",
                    family=sf.MONO, fontsize=sf.SMALL + 0.5, fontweight="bold",
                    color=PAIR_EDGE[j])
            ax.text(cx, cy - r - 0.3, f"\u03b8 = p \u00b7 {per_pos[j]:.4g}", ha="center",
                    va="center", fontsize=sf.SMALL, color=sf.INK)
            ax.text(cx, cy - r - 0.5,
                    f"p = {N_POS - 1}: {math.degrees(last):.3g}\u00b0 (mod 360)" if j == 0
                    else f"p = {N_POS - 1}: {math.degrees(last):.2g}\u00b0",
                    ha="center", va="center", fontsize=sf.SMALL, color=sf.GREY)
        ax.text(0.15, 0.2, "Both layouts turn pair j by the same angle; they differ only in "
                "which two dimensions form pair j.", fontsize=sf.TEXT, color=sf.INK,
                va="center")
        return sf.save(plt, fig, out, "rope_pairs.py")


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
