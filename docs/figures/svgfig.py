"""What the figure scripts of ``docs/figures/`` share: a canvas in inches, boxes, arrows, SVG out.

The pictures are drawn with matplotlib and written as SVG with the text left as text
(``svg.fonttype = none``): the browser draws it with its own sans-serif and monospace fonts,
nothing is embedded or fetched. The output is deterministic (a fixed ``svg.hashsalt`` for the
ids, no date in the metadata, the script's name as its creator), so drawing a picture again
gives the same bytes, which is what ``tests/docs/test_figures.py`` compares.

Sizes: a figure is ``WIDTH`` = 8 inches wide, shown at its natural 768 px in the site's
868 px content column (``docs/assets/stylesheets/extra.css``), 4/3 px per point: the
smallest text, ``SMALL`` = 9 pt, is 12 px on the page.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "docs" / "assets" / "figures"
if str(ROOT) not in sys.path:  # run as a script: reference/ is beside docs/
    sys.path.insert(0, str(ROOT))

WIDTH = 8.0  # inches: 768 px on the page
SMALL = 9.0  # pt: the smallest text of a figure (12 px on the page)
TEXT = 10.5  # pt: ordinary labels
MONO = "monospace"
INK = "#222222"  # text
GREY = "#666666"  # secondary text, arrows
LINE = "#444444"  # box edges
# one colour per sequence (light fill, dark edge), the same in every picture
SEQ_FILL = ["#cfe0f5", "#fbdcc4", "#d4edd4", "#eadcf2"]
SEQ_EDGE = ["#34629c", "#b86b1b", "#3f7f3c", "#7a4f99"]


@contextlib.contextmanager
def style() -> Iterator[object]:
    """matplotlib's ``pyplot`` under the settings every picture is drawn with."""
    import matplotlib

    matplotlib.use("agg")  # measures the text; the file is written as SVG all the same
    import matplotlib.pyplot as plt

    with plt.rc_context({
        "svg.fonttype": "none",  # text as text: selectable, searchable, small
        "svg.hashsalt": "llamaref",  # the same ids on every run
        "font.family": "sans-serif",
        "font.size": TEXT,
        "hatch.linewidth": 0.8,
    }):
        yield plt


def canvas(plt, height: float, width: float = WIDTH):
    """A white figure and one axes over all of it, 1 unit = 1 inch, origin bottom left."""
    fig = plt.figure(figsize=(width, height), facecolor="white")
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def save(plt, fig, out: Path, script: str) -> Path:
    """Write ``fig`` as SVG to ``out`` (no date, ``script`` as the creator) and close it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="svg", metadata={"Date": None, "Creator": f"docs/figures/{script}"})
    plt.close(fig)
    return out


def box(ax, x: float, y: float, w: float, h: float, fill: str = "white", edge: str = LINE,
        lw: float = 1.2, rounding: float = 0.08, **kw) -> None:
    """A rounded rectangle with its lower left corner at ``(x, y)``."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=f"round,pad=0,rounding_size={rounding}",
                                facecolor=fill, edgecolor=edge, linewidth=lw, **kw))


def rect(ax, x: float, y: float, w: float, h: float, fill: str = "white", edge: str = LINE,
         lw: float = 0.8, **kw) -> None:
    """A square-cornered rectangle with its lower left corner at ``(x, y)``."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=fill, edgecolor=edge, linewidth=lw, **kw))


def arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str = GREY,
          lw: float = 1.3, style: str = "-|>,head_length=0.5,head_width=0.25",
          connection: str = "arc3") -> None:
    """An arrow from ``start`` to ``end`` (``connection``: matplotlib's connectionstyle)."""
    ax.annotate("", xy=end, xytext=start,
                arrowprops={"arrowstyle": style, "color": color, "linewidth": lw,
                            "shrinkA": 0, "shrinkB": 0, "connectionstyle": connection})


def text_width(ax, s: str, **kw) -> float:
    """The width in inches of ``s`` drawn with ``kw`` (measured, then removed)."""
    t = ax.text(0, 0, s, **kw)
    width = t.get_window_extent(ax.figure.canvas.get_renderer()).width / ax.figure.dpi
    t.remove()
    return width


def kv_cell(ax, cells, i: int, x: float, y: float, cw: float, row: float, in_slot: bool,
            fontsize: float) -> None:
    """Cell ``i`` of a KV cache's ``cells`` as a square at ``(x, y)``, ``cw`` wide and ``row``
    high: dashed when empty, else striped by its sequences, framed black when the ubatch
    wrote it, its position inside."""
    seqs = sorted(cells.seq_get_all(i))
    if not seqs:
        rect(ax, x + 0.02, y, cw - 0.04, row, fill="white", edge="#bbbbbb",
             linestyle=(0, (2, 2)))
        return
    w = (cw - 0.04) / len(seqs)
    for k, s in enumerate(seqs):
        rect(ax, x + 0.02 + k * w, y, w, row, fill=SEQ_FILL[s], edge="none", lw=0)
    edge, lw = ("#111111", 2.0) if in_slot else ("#888888", 0.8)
    rect(ax, x + 0.02, y, cw - 0.04, row, fill="none", edge=edge, lw=lw)
    ax.text(x + cw / 2, y + row / 2, str(cells.pos_get(i)), ha="center", va="center",
            fontsize=fontsize, color=INK)


def mask_legend(ax, y: float, n_swa: int) -> None:
    """The legend line of a KQ mask drawn by ``kv_cells.py`` and ``iswa.py``: seen, hidden by
    the window only (hatched), hidden otherwise."""
    x = 0.15
    for fill, edge, hatch, label in [
        (SEQ_EDGE[0], "none", None, "0: the token sees it"),
        ("white", SEQ_EDGE[0], "////", f"\u2212inf: outside the window (n_swa = {n_swa})"),
        ("#f4f4f4", "#dddddd", None, "\u2212inf: other sequence, empty, later"),
    ]:
        rect(ax, x, y - 0.1, 0.28, 0.2, fill=fill, edge=edge, hatch=hatch)
        ax.text(x + 0.36, y, label, va="center", fontsize=SMALL, color=INK)
        x += 0.55 + text_width(ax, label, fontsize=SMALL)
