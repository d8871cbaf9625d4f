"""Draw the default sampler chain on one logits row: ``docs/assets/figures/sampler_chain.svg``.

Run from anywhere, after changing ``reference/sampling.py``::

    python docs/figures/sampler_chain.py

and commit the SVG (the docs build runs this too, through ``docs/figures/hook.py``). The
chain is ``SamplerChain.from_params(SamplerParams(seed=SEED))``, llama.cpp's common default,
run stage by stage on a fixed seeded logits row of ``N_VOCAB`` tokens (``logits``). After
each stage the picture shows which candidates are left and their probabilities: the softmax
of the candidates left, computed by ``reference.sampling.softmax`` on a copy, which is what
the next probability-based sampler sees. Stages that change nothing with the default
parameters are named but get no column. The token drawn must be the one
``SamplerChain.sample`` returns for the same row and seed, or the script fails.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # svgfig, beside this file
    sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import svgfig as sf  # noqa: E402

from reference.sampling import (  # noqa: E402
    SamplerChain,
    SamplerParams,
    TokenDataArray,
    softmax,
)

OUT = sf.OUT_DIR / "sampler_chain.svg"
N_VOCAB = 256
SEED = 42  # the chain's seed (dist's draw)
N_ROWS = 8  # candidates drawn one per row: the largest logits
SCALE = 2.5  # the logits' standard deviation: a few likely tokens and a long tail


def logits() -> np.ndarray:
    """The row the chain runs on: seeded normal logits ``(N_VOCAB,)``, float32."""
    return (SCALE * np.random.default_rng(0).standard_normal(N_VOCAB)).astype(np.float32)


def setting(params: SamplerParams, stage: str) -> str:
    """The parameter of a stage, as the column heading shows it."""
    names = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "temperature": "temp",
             "typ_p": "typ_p", "top_n_sigma": "top_n_sigma", "xtc": "xtc_probability"}
    if stage == "dist":
        return f"seed {params.seed}"
    return f"{names[stage]} = {getattr(params, names[stage]):g}" if stage in names else ""


def run() -> tuple[SamplerChain, list[tuple[str, TokenDataArray]], list[str]]:
    """The chain, the candidates after each stage that changed them (the input first), and
    the stages that changed nothing."""
    row = logits()
    chain = SamplerChain.from_params(SamplerParams(seed=SEED), N_VOCAB)
    cur = TokenDataArray.from_logits(row)
    states, idle = [("input", copy.deepcopy(cur))], []
    for stage in chain.stages:  # SamplerChain.sample, one stage at a time
        before = copy.deepcopy(cur)
        chain._apply(stage, cur)
        same = (np.array_equal(before.ids, cur.ids) and np.array_equal(before.logits, cur.logits)
                and np.array_equal(before.p, cur.p) and before.selected == cur.selected)
        if same:
            idle.append(stage)
        else:
            states.append((stage, copy.deepcopy(cur)))
    again = SamplerChain.from_params(SamplerParams(seed=SEED), N_VOCAB).sample(row)
    assert int(cur.ids[cur.selected]) == again, "the stages did not do what sample() does"
    return chain, states, idle


def probabilities(cur: TokenDataArray) -> dict[int, float]:
    """Token id -> its probability among the candidates left (softmax of a copy)."""
    c = copy.deepcopy(cur)
    softmax(c, do_sort=False)
    return dict(zip(c.ids.tolist(), c.p.tolist(), strict=True))


ID_W = 1.0  # the first column: token and logit
COL_W = (8.0 - 0.15 - ID_W - 0.1) / 6  # a stage
ROW_H = 0.3
BAR = 0.55  # inches for p = 1


def draw(out: Path = OUT) -> Path:
    """Run the chain, draw the picture and write it as SVG to ``out``."""
    chain, states, idle = run()
    assert len(states) <= 6, "more stages than columns"
    first = states[0][1]
    order = np.argsort(-first.logits, kind="stable")[:N_ROWS]
    ids = first.ids[order].tolist()  # the rows: the largest logits
    z = dict(zip(first.ids.tolist(), first.logits.tolist(), strict=True))
    height = 0.3 + 0.45 + 0.75 + (N_ROWS + 1) * ROW_H + 0.75
    with sf.style() as plt:
        fig, ax = sf.canvas(plt, height)
        y = height - 0.3
        # the whole chain, in order; grey: no effect with the default parameters
        x = 0.15
        ax.text(x, y, "chain:", fontsize=sf.TEXT, color=sf.INK, va="center")
        x += 0.55
        for k, stage in enumerate(chain.stages):
            color = sf.GREY if stage in idle else sf.INK
            weight = None if stage in idle else "bold"
            ax.text(x, y, stage, family=sf.MONO, fontsize=sf.SMALL, color=color,
                    fontweight=weight, va="center")
            x += sf.text_width(ax, stage, family=sf.MONO, fontsize=sf.SMALL,
                               fontweight=weight)
            if k + 1 < len(chain.stages):
                ax.text(x + 0.04, y, "\u2192", fontsize=sf.SMALL, color=sf.GREY, va="center")
                x += 0.22
        y -= 0.27
        ax.text(0.7, y, f"grey: no effect with the default SamplerParams(); {N_VOCAB} "
                "seeded logits in, one token out", fontsize=sf.SMALL, color=sf.GREY,
                va="center")

        # column headings: the stage, its setting, how many candidates are left
        y -= 0.45
        ax.text(0.15, y + 0.1, "token", fontsize=sf.TEXT, color=sf.INK, va="center",
                fontweight="bold")
        ax.text(0.15, y - 0.13, "logit", fontsize=sf.SMALL, color=sf.GREY, va="center")
        for c, (stage, cur) in enumerate(states):
            x = 0.15 + ID_W + c * COL_W
            name = "all logits" if stage == "input" else stage
            ax.text(x, y + 0.2, name, family=sf.MONO, fontsize=sf.SMALL + 0.5,
                    fontweight="bold", color=sf.INK, va="center")
            ax.text(x, y, setting(chain.params, stage) if stage != "input" else "softmax",
                    fontsize=sf.SMALL, color=sf.GREY, va="center")
            ax.text(x, y - 0.2, f"{cur.size} left", fontsize=sf.SMALL, color=sf.INK,
                    va="center")
        y -= 0.35
        ax.plot([0.15, 7.85], [y, y], color="#cccccc", lw=1.0)

        # one row per candidate: its probability after each stage, or gone
        sel = states[-1][1]
        chosen = int(sel.ids[sel.selected]) if sel.selected >= 0 else None
        for r, t in enumerate(ids + [None]):
            yy = y - (r + 0.5) * ROW_H
            if t is None:
                ax.text(0.15, yy, "the others", fontsize=sf.SMALL, color=sf.GREY,
                        va="center")
            else:
                ax.text(0.15, yy, str(t), family=sf.MONO, fontsize=sf.TEXT,
                        fontweight="bold", color=sf.INK, va="center")
                ax.text(0.6, yy, f"{z[t]:.2f}", family=sf.MONO, fontsize=sf.SMALL,
                        color=sf.GREY, va="center")
            for c, (stage, cur) in enumerate(states):
                x = 0.15 + ID_W + c * COL_W
                p = probabilities(cur)
                if t is None:  # the rest, counted
                    rest = [q for i, q in p.items() if i not in ids]
                    text = f"{len(rest)}, p {sum(rest):.2f}" if rest else "none left"
                    ax.text(x, yy, text, fontsize=sf.SMALL, color=sf.GREY, va="center")
                    continue
                if t not in p:
                    ax.text(x + 0.05, yy, "\u2013", fontsize=sf.TEXT, color="#bbbbbb",
                            va="center")
                    continue
                is_pick = stage == "dist" and t == chosen
                sf.rect(ax, x, yy - 0.09, max(BAR * p[t], 0.01), 0.18,
                        fill="#34629c" if not is_pick else "#b86b1b", edge="none", lw=0)
                ax.text(x + BAR + 0.05, yy, f"{p[t]:.2f}", family=sf.MONO,
                        fontsize=sf.SMALL, color=sf.INK, va="center",
                        fontweight="bold" if is_pick else None)
        if chosen is not None:
            r = ids.index(chosen)
            x = 0.15 + ID_W + (len(states) - 1) * COL_W
            sf.rect(ax, x - 0.05, y - (r + 1) * ROW_H + 0.02, COL_W - 0.02, ROW_H - 0.04,
                    fill="none", edge="#b86b1b", lw=1.6)
        y -= (N_ROWS + 1) * ROW_H + 0.3
        ax.text(0.15, y, "p: the softmax of the candidates left after the stage (what the next "
                "sampler sees).\n"
                f"dist draws token {chosen} (orange), as SamplerChain.sample does with seed "
                f"{SEED}.", fontsize=sf.SMALL, color=sf.GREY, va="center", linespacing=1.5)
        return sf.save(plt, fig, out, "sampler_chain.py")


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
