"""Draw the three layers of llamaref and their imports: ``docs/assets/figures/layers.svg``.

Run from anywhere, after changing a layer's main modules::

    python docs/figures/layers.py

and commit the SVG. Text stays text in the SVG (``svg.fonttype = none``): the browser draws
it with its own sans-serif and monospace fonts, nothing is embedded or fetched. Every module
named in the picture must exist, so the picture cannot name a module that was moved away.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "assets" / "figures" / "layers.svg"

# From the top of the picture down: (package, what it is, one line saying so, groups of main
# modules). A group is (label, modules); the label (or "") opens its first line.
LAYERS = [
    ("llamaref/", "the application", "what the user runs: flags, threads, files, HTTP",
     [("", ["cli.py", "backends.py", "server/", "bench/", "verify.py", "llamacpp.py"])]),
    ("accelerated/", "the MLX twin", "the array work again in MLX: same paths, names, shapes",
     [("", ["ops/", "quants.py", "models/", "memory/", "context.py", "sampling.py"])]),
    ("reference/", "the specification",
     "NumPy: what the chapters show; the library never imports tools/",
     [("library", ["ops/", "models/", "memory/", "batch.py", "context.py", "sampling.py",
                   "quants.py", "gguf.py", "hf.py", "hparams.py", "arch.py", "tokenizer/",
                   "model_loader.py", "common.py", "testing.py"]),
      ("tools/", ["generate", "batched", "batched_bench", "parallel", "speculative",
                  "lookup", "self_extend", "passkey", "perplexity", "server/"])]),
]
FILL = {"llamaref/": "#fbe3c8", "accelerated/": "#d9eed8", "reference/": "#d6e4f5"}
EDGE = {"llamaref/": "#b86b1b", "accelerated/": "#3f7f3c", "reference/": "#34629c"}

WIDTH = 8.0  # inches; shown at 700 px this is 87.5 px per inch, 11 pt is about 13 px
BOX_X0, BOX_X1 = 0.15, 6.55  # the boxes; the lane on their right carries the long arrow
LANE_X = 7.25
LINE_H = 0.26  # one line of text, in inches
GAP = 0.75  # between two boxes: room for an arrow and its label
MAX_CHARS = 64  # monospace characters per line of module names


def _exists(package: str, name: str) -> bool:
    """A module of the picture exists: ``name`` as written, or under ``tools/`` (``.py`` added
    to a name without one)."""
    tools = ROOT / package / "tools"
    return any(path.exists() for path in (ROOT / package / name, tools / name,
                                          tools / f"{name}.py"))


def module_lines(package: str, groups: list[tuple[str, list[str]]]) -> list[str]:
    """Wrap each group's module names into lines of at most ``MAX_CHARS``, its label first;
    every module must exist."""
    lines = []
    for label, modules in groups:
        for name in modules:
            if not _exists(package, name):
                raise SystemExit(f"layers.py: {package}{name} does not exist; update LAYERS")
        line = f"{label}:" if label else ""
        for name in modules:  # SVG collapses runs of spaces: a dot keeps the names apart
            sep = " " if line.endswith(":") else " \u00b7 "
            candidate = f"{line}{sep}{name}" if line else name
            if len(candidate) > MAX_CHARS:
                lines.append(line)
                # no-break spaces (SVG collapses plain ones) line the names up under the first
                candidate = "\u00a0" * (len(label) + 2) + name if label else name
            line = candidate
        lines.append(line)
    return lines


def box_height(n_lines: int) -> float:
    """Title, description, a little air, then the module lines."""
    return 0.5 + 0.36 + 0.12 + n_lines * LINE_H + 0.18


def draw_box(ax, package: str, role: str, line: str, mods: list[str], y_top: float) -> float:
    """One layer as a rounded box whose top edge is at ``y_top``; returns its bottom edge."""
    from matplotlib.patches import FancyBboxPatch

    h = box_height(len(mods))
    ax.add_patch(FancyBboxPatch((BOX_X0, y_top - h), BOX_X1 - BOX_X0, h,
                                boxstyle="round,pad=0,rounding_size=0.12",
                                facecolor=FILL[package], edgecolor=EDGE[package], linewidth=1.6))
    x = BOX_X0 + 0.2
    y = y_top - 0.32
    name = ax.text(x, y, package, family="monospace", fontsize=15, fontweight="bold",
                   color=EDGE[package], va="center")
    box = name.get_window_extent(ax.figure.canvas.get_renderer())  # in pixels
    x_role = x + box.width / ax.figure.dpi + 0.15  # inches: the axes are 1 unit per inch
    ax.text(x_role, y, role, fontsize=14, fontweight="bold", color="#222222", va="center")
    y -= 0.38
    ax.text(x, y, line, fontsize=11.5, color="#333333", va="center")
    y -= 0.12 + LINE_H
    for text in mods:
        ax.text(x, y, text, family="monospace", fontsize=11, color="#111111", va="center")
        y -= LINE_H
    return y_top - h


def arrow(ax, xy_from, xy_to, color="#444444") -> None:
    """An import arrow: from the importing layer to the imported one."""
    ax.annotate("", xy=xy_to, xytext=xy_from,
                arrowprops={"arrowstyle": "-|>,head_length=0.6,head_width=0.3",
                            "color": color, "linewidth": 1.6, "shrinkA": 0, "shrinkB": 0})


def draw(out: Path = OUT) -> Path:
    """Draw the picture and write it as SVG to ``out``."""
    import matplotlib

    matplotlib.use("agg")  # measures the text; the file is written as SVG all the same
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text as text: selectable, searchable, small
    plt.rcParams["svg.hashsalt"] = "llamaref-layers"  # the same ids on every run
    plt.rcParams["font.family"] = "sans-serif"

    blocks = [(p, r, d, module_lines(p, m)) for p, r, d, m in LAYERS]
    height = 0.25 + sum(box_height(len(b[3])) for b in blocks) + GAP * (len(blocks) - 1) + 0.55
    fig = plt.figure(figsize=(WIDTH, height), facecolor="white")
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH)
    ax.set_ylim(0, height)
    ax.axis("off")

    y = height - 0.2
    edges = []  # (top, bottom) of each box
    for i, block in enumerate(blocks):
        bottom = draw_box(ax, *block, y)
        edges.append((y, bottom))
        y = bottom - GAP if i < len(blocks) - 1 else bottom

    # llamaref -> accelerated -> reference, straight down the middle
    x_mid = 2.2
    for (_, upper_bottom), (lower_top, _) in zip(edges, edges[1:], strict=False):
        arrow(ax, (x_mid, upper_bottom), (x_mid, lower_top))
        ax.text(x_mid + 0.15, (upper_bottom + lower_top) / 2, "imports", fontsize=11,
                style="italic", color="#444444", va="center")

    # llamaref -> reference, past accelerated, along the lane on the right
    (app_top, app_bottom), _, (ref_top, ref_bottom) = edges
    y_from, y_to = (app_top + app_bottom) / 2, (ref_top + ref_bottom) / 2
    ax.plot([BOX_X1, LANE_X, LANE_X], [y_from, y_from, y_to], color="#444444", linewidth=1.6,
            solid_joinstyle="round")
    arrow(ax, (LANE_X, y_to), (BOX_X1, y_to))
    ax.text(LANE_X + 0.12, (y_from + y_to) / 2, "imports", fontsize=11, style="italic",
            color="#444444", rotation=90, ha="left", va="center")

    # reference imports nothing of ours: said under its box
    ax.text((BOX_X0 + BOX_X1) / 2, ref_bottom - 0.3,
            "reference/ imports nothing of ours; its library imports none of its tools/",
            fontsize=11.5, fontweight="bold", color=EDGE["reference/"], ha="center",
            va="center")

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="svg", metadata={"Date": None, "Creator": "docs/figures/layers.py"})
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
