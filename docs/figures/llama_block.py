"""Draw the Llama block, a layer's data flow and shapes: ``docs/assets/figures/llama_block.svg``.

Run from anywhere, after changing ``reference/models/llama.py`` or the ops it calls::

    python docs/figures/llama_block.py

and commit the SVG (the docs build runs this too, through ``docs/figures/hook.py``). The
shapes are not typed here: a real forward runs first, a ubatch of ``N_TOKENS`` tokens on
the model of ``tiny_hparams()`` with a real ``KVCache`` behind it, and every op the graph
calls records the shape it returns (``record_forward``). The picture is drawn from that
record. The record must be the op sequence ``LAYER_OPS`` for each layer, so when the graph
changes (an op added, removed or moved) this script fails instead of drawing the old one.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # svgfig, beside this file
    sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import svgfig as sf  # noqa: E402

from reference.batch import Ubatch  # noqa: E402
from reference.memory import KVCache  # noqa: E402
from reference.models import llama  # noqa: E402
from reference.ops import attention  # noqa: E402
from reference.testing import random_weights, tiny_hparams  # noqa: E402

OUT = sf.OUT_DIR / "llama_block.svg"
N_PAST = 2  # tokens already in the cache when the drawn ubatch runs
N_TOKENS = 3  # tokens of the drawn ubatch; the last one outputs (llama.cpp's default)
KV_SIZE = 8  # cells of the cache: n_kv is padded up to them

# The ops one layer calls, in order, as recorded (module.function). The last layer takes
# the output rows (get_rows twice) between the attention and the residual add.
LAYER_OPS = [
    "rms_norm", "mul",  # build_norm(attn_norm)
    "mul_mat", "mul_mat", "mul_mat",  # build_qkv: q, k, v
    "rope_ext", "rope_ext",  # q, k
    "cpy_k", "cpy_v", "get_k", "get_v", "get_kq_mask",  # the memory's attention input
    "attention.mul_mat", "attention.soft_max_ext", "attention.mul_mat",  # build_attn_mha
    "build_attn_mha",
    "mul_mat",  # wo
    "add",  # the residual
    "rms_norm", "mul",  # build_norm(ffn_norm)
    "mul_mat", "mul_mat", "swiglu", "mul_mat",  # build_ffn: up, gate, swiglu, down
    "add",  # the residual
]
OUT_ROWS = ["get_rows", "get_rows"]  # the last layer: cur and inpSA, output rows only
HEAD_OPS = ["rms_norm", "mul", "mul_mat"]  # output_norm, then the lm_head


class RecordedInput:
    """The memory's attention input, recording what goes in and out of it."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if not callable(method):  # an attribute (n_stream), not a call to record
            return method

        def call(il, *args):
            result = method(il, *args)
            shape = args[0].shape if args else result.shape  # cpy_*: what is stored
            self.log.append((name, tuple(shape)))
            return result

        return call


def record_forward() -> tuple[object, dict, list[tuple[str, tuple[int, ...]]]]:
    """Run the drawn ubatch through ``llama_forward`` and record ``(op, shape)`` per op call.

    Returns:
        ``(hparams, sizes, record)``: the sizes of the ubatch (``n_tokens``, ``n_kv``,
        ``n_outputs``) and the record of the forward after the embedding.
    """
    hp = tiny_hparams()
    weights = random_weights(hp, seed=0)
    cache = KVCache(hp, kv_size=KV_SIZE)

    def ubatch(pos):
        n = len(pos)
        return Ubatch(token=np.arange(n, dtype=np.int32), embd=None,
                      pos=np.asarray(pos, np.int32), seq_id=((0,),) * n, seq_id_unq=(0,),
                      output=np.ones(n, bool), idx=np.arange(n), equal_seqs=False,
                      n_seq_tokens=1, n_seqs=n)

    def forward(ub, out_ids, log=None):
        [sinfo] = cache.prepare([ub])
        cache.apply_ubatch(sinfo, ub)
        inp = cache.attn_input(ub, sinfo)
        if log is not None:
            inp = RecordedInput(inp, log)
        return inp, llama.llama_forward(weights, hp, ub.token, ub.pos, inp, out_ids)

    forward(ubatch(range(N_PAST)), None)  # the past: keys and values already in the cache
    log: list[tuple[str, tuple[int, ...]]] = []

    def recorded(module, name, tag):
        real = getattr(module, name)

        def op(*args, **kwargs):
            result = real(*args, **kwargs)
            log.append((tag, result.shape))
            return result

        return mock.patch.object(module, name, op)

    with ExitStack() as stack:
        for name in ("get_rows", "rms_norm", "mul", "mul_mat", "add", "swiglu", "build_attn_mha"):
            stack.enter_context(recorded(llama, name, name))
        # the forward's graph_rope builds one cos/sin cache and turns each q and k with
        # rotate_pairs: one rope_ext node of ggml's graph per call
        stack.enter_context(recorded(llama, "rotate_pairs", "rope_ext"))
        for name in ("mul_mat", "soft_max_ext"):
            stack.enter_context(recorded(attention, name, f"attention.{name}"))
        out_ids = np.array([N_TOKENS - 1])
        inp, logits = forward(ubatch(range(N_PAST, N_PAST + N_TOKENS)), out_ids, log)
    sizes = {"n_tokens": N_TOKENS, "n_kv": inp.inner.n_kv, "n_outputs": len(out_ids)}
    assert logits.shape == (len(out_ids), hp.n_vocab)
    return hp, sizes, log


def layers(hp, record) -> tuple[tuple, list[tuple], list[tuple], list[tuple]]:
    """Cut the record into the embedding, the first layer, the last layer's row picking and
    the head.

    Raises:
        SystemExit: the record is not ``get_rows``, ``LAYER_OPS`` per layer (``OUT_ROWS``
            before the last layer's first ``add``), ``HEAD_OPS``: the graph changed.
    """
    i_add = LAYER_OPS.index("add")
    expected = ["get_rows"]
    for il in range(hp.n_layer):
        ops = list(LAYER_OPS)
        if il == hp.n_layer - 1:
            ops[i_add:i_add] = OUT_ROWS
        expected += ops
    expected += HEAD_OPS
    names = [name for name, _ in record]
    if names != expected:
        raise SystemExit(f"llama_block.py: the forward called {names}, the picture expects "
                         f"{expected}; update LAYER_OPS and the drawing")
    per_layer = len(LAYER_OPS)
    first = record[1:1 + per_layer]
    last = record[1 + per_layer * (hp.n_layer - 1):-len(HEAD_OPS)]
    return record[0], first, last[i_add:i_add + len(OUT_ROWS)], record[-len(HEAD_OPS):]


def shape(s: tuple[int, ...]) -> str:
    """``(3, 16)``; a 1-tuple as ``(3,)``."""
    return str(tuple(int(n) for n in s))


def steps(hp, record) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """The boxes of the picture: name -> ``(kind, [(line, shape), ...])``, shapes recorded."""
    embd, ly, out_rows, head = layers(hp, record)
    s = [shape(r[1]) for r in ly]
    kq_scale = 1.0 / hp.n_embd_head_k**0.5  # llm_build_llama's default scale
    return {
        "build_inp_embd": ("io", [("get_rows(token_embd, tokens)", shape(embd[1]))]),
        "build_norm": ("norm", [("rms_norm(x) * attn_norm", s[1])]),
        "build_qkv": ("mat", [("q = mul_mat(wq, cur)", s[2]), ("k = mul_mat(wk, cur)", s[3]),
                              ("v = mul_mat(wv, cur)", s[4])]),
        "rope_ext": ("rope", [("q: n_head heads at pos", s[5]),
                              ("k: n_head_kv heads at pos", s[6])]),
        "build_attn": ("attn", [
            ("cpy_k(k), cpy_v(v): to cells", s[7]),
            ("K, V = get_k(), get_v()", s[9]),
            ("mask = get_kq_mask()", s[11]),
            ("kq = mul_mat(K, q), GQA", s[12]),
            (f"soft_max_ext(kq, mask, {kq_scale:g})", s[13]),
            ("kqv = mul_mat(V, kq)", s[14]),
            ("kqv, heads side by side", s[15]),
            ("mul_mat(wo, kqv)", s[16]),
        ]),
        "add": ("add", [("y = x + attention", s[17])]),
        "build_norm ": ("norm", [("rms_norm(y) * ffn_norm", s[19])]),
        "build_ffn": ("mat", [("u = mul_mat(ffn_up, cur)", s[20]),
                              ("g = mul_mat(ffn_gate, cur)", s[21]),
                              ("swiglu(g, u)", s[22]),
                              ("mul_mat(ffn_down, cur)", s[23])]),
        "add ": ("add", [("x = y + ffn", s[24])]),
        "output": ("io", [("rms_norm(x) * output_norm", shape(head[1][1])),
                          ("logits: mul_mat(output, cur)", shape(head[2][1]))]),
        "out_rows": ("", [("", shape(out_rows[0][1]))]),
    }


FILL = {"io": "#eeeeee", "norm": "#fff3c4", "mat": "#d6e4f5", "rope": "#e6dcf2",
        "attn": "#d4edd4", "add": "#ffffff"}
EDGE = {"io": "#666666", "norm": "#a08a2c", "mat": "#34629c", "rope": "#7a4f99",
        "attn": "#3f7f3c", "add": "#444444"}

LINE_H = 0.23  # inches per line of a box
PAD = 0.1  # above and below a box's lines
GAP = 0.32  # between two boxes: an arrow, and the next box's name on its top edge
LEFT = (0.4, 3.9)  # the two columns of boxes
RIGHT = (4.4, 7.6)
GUTTER = (LEFT[1] + RIGHT[0]) / 2
LANE = 7.85  # the second residual
FONT = 9.5  # pt, the lines of the boxes


def box_height(lines: list) -> float:
    return len(lines) * LINE_H + 2 * PAD


def draw_box(ax, name: str, kind: str, lines: list, col: tuple[float, float], top: float
             ) -> float:
    """A helper as a box of op lines with their shapes; its name on the top edge. Returns
    the bottom edge."""
    x0, x1 = col
    h = box_height(lines)
    sf.box(ax, x0, top - h, x1 - x0, h, fill=FILL[kind], edge=EDGE[kind])
    for j, (line, shp) in enumerate(lines):
        y = top - PAD - (j + 0.5) * LINE_H
        ax.text(x0 + 0.12, y, line, family=sf.MONO, fontsize=FONT, color=sf.INK, va="center")
        ax.text(x1 - 0.12, y, shp, family=sf.MONO, fontsize=FONT, color=EDGE[kind],
                va="center", ha="right", fontweight="bold")
    if name:
        ax.text(x0 + 0.15, top, name.strip(), family=sf.MONO, fontsize=sf.SMALL,
                fontweight="bold", color=EDGE[kind], va="center",
                bbox={"boxstyle": "square,pad=0.15", "facecolor": "white", "edgecolor": "none"})
    return top - h


def draw(out: Path = OUT) -> Path:
    """Record the forward, draw the picture and write it as SVG to ``out``."""
    hp, sizes, record = record_forward()
    b = steps(hp, record)
    legend = [
        ("tiny_hparams():", ""),
        (f"n_embd {hp.n_embd}, n_ff {hp.n_ff}, n_vocab {hp.n_vocab}", ""),
        (f"n_head {hp.n_head}, n_head_kv {hp.n_head_kv}, d {hp.n_embd_head_k}", ""),
        (f"this ubatch: n_tokens {sizes['n_tokens']},", ""),
        (f"n_kv {sizes['n_kv']} cells, n_outputs {sizes['n_outputs']}", ""),
    ]
    left = ["build_norm", "build_qkv", "rope_ext", "build_attn"]
    right = ["add", "build_norm ", "build_ffn", "add "]
    h_left = sum(box_height(b[k][1]) for k in left) + GAP * (len(left) - 1)
    h_top = box_height(b["build_inp_embd"][1])
    frame_pad = 0.3
    h_bottom = max(box_height(b["output"][1]), box_height(legend))
    height = 0.15 + h_top + 0.55 + h_left + frame_pad + GAP + h_bottom + 0.15

    with sf.style() as plt:
        fig, ax = sf.canvas(plt, height)
        y_top = height - 0.15
        y_embd = draw_box(ax, "build_inp_embd", *b["build_inp_embd"], LEFT, y_top)

        # the layer's frame, dashed
        frame_top = y_top - h_top - 0.55 + frame_pad
        frame_bottom = frame_top - frame_pad - h_left - frame_pad
        sf.box(ax, 0.12, frame_bottom, 8.0 - 0.24, frame_top - frame_bottom, fill="none",
               edge="#999999", lw=1.0, rounding=0.12, linestyle=(0, (4, 3)))

        x_left = (LEFT[0] + LEFT[1]) / 2
        x_right = (RIGHT[0] + RIGHT[1]) / 2
        y = frame_top - frame_pad
        sf.arrow(ax, (x_left, y_embd), (x_left, y))
        y_res = y_embd - 0.17  # where the residual leaves the layer's input
        edges = {}
        for k, name in enumerate(left):
            bottom = draw_box(ax, name, *b[name], LEFT, y)
            edges[name] = (y, bottom)
            if k + 1 < len(left):
                sf.arrow(ax, (x_left, bottom), (x_left, bottom - GAP))
            y = bottom - GAP
        y = frame_top - frame_pad
        for k, name in enumerate(right):
            bottom = draw_box(ax, name, *b[name], RIGHT, y)
            edges[name] = (y, bottom)
            if k + 1 < len(right):
                sf.arrow(ax, (x_right, bottom), (x_right, bottom - GAP))
            y = bottom - GAP

        # attention -> the first add: down, along the gutter, up into its left side
        add_top, add_bottom = edges["add"]
        y_add = (add_top + add_bottom) / 2
        attn_bottom = edges["build_attn"][1]
        y_turn = attn_bottom - 0.15
        ax.plot([x_left, x_left, GUTTER, GUTTER], [attn_bottom, y_turn, y_turn, y_add],
                color=sf.GREY, lw=1.3)
        sf.arrow(ax, (GUTTER, y_add), (RIGHT[0], y_add))
        # the residuals: the layer's input into the first add, y into the second
        ax.plot([x_left, x_right - 0.9], [y_res, y_res], color=sf.GREY, lw=1.3)
        ax.plot([x_right - 0.9] * 2, [y_res, add_top + 0.15], color=sf.GREY, lw=1.3)
        sf.arrow(ax, (x_right - 0.9, add_top + 0.15), (x_right - 0.9, add_top))
        norm2_top = edges["build_norm "][0]
        y_res2 = norm2_top + GAP / 2
        add2_top, add2_bottom = edges["add "]
        y_add2 = (add2_top + add2_bottom) / 2
        ax.plot([x_right, LANE, LANE], [y_res2, y_res2, y_add2], color=sf.GREY, lw=1.3)
        sf.arrow(ax, (LANE, y_add2), (RIGHT[1], y_add2))
        ax.text(LANE - 0.08, (y_res2 + y_add2) / 2, "residual", rotation=90, fontsize=sf.SMALL,
                color=sf.GREY, ha="right", va="center", style="italic")
        ax.text(x_right - 0.82, (y_res + frame_top) / 2, "residual", fontsize=sf.SMALL,
                color=sf.GREY, ha="left", va="center", style="italic")

        # notes in the free corner of the frame
        notes = (
            "K, V: every cell in view (n_kv),\n"
            "written and read through the\n"
            "memory's attention input; the\n"
            "mask hides the cells a token\n"
            "may not see. GQA: q head h\n"
            f"reads KV head h // {hp.n_head // hp.n_head_kv}.\n\n"
            "The last layer keeps only the\n"
            f"output rows, {b['out_rows'][1][0][1]}, before its\n"
            "first add: get_rows(out_ids)."
        )
        ax.text(RIGHT[0] + 0.05, edges["add "][1] - 0.12, notes, fontsize=sf.SMALL,
                color=sf.GREY, va="top", linespacing=1.4)
        ax.text(LEFT[0], frame_bottom, f" one layer, repeated n_layer = {hp.n_layer} times ",
                fontsize=sf.TEXT, color=sf.GREY, ha="left", va="center", style="italic",
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none"})

        # out of the last layer: the head, on the right; the sizes on the left
        y_out = frame_bottom - GAP + 0.05
        x_out = RIGHT[1] - 0.45
        sf.arrow(ax, (x_out, add2_bottom), (x_out, y_out))
        draw_box(ax, "output", *b["output"], RIGHT, y_out)
        x0, x1 = LEFT
        h = box_height(legend)
        sf.box(ax, x0, y_out - h, x1 - x0, h, fill="white", edge="#bbbbbb", lw=1.0)
        for j, (line, _) in enumerate(legend):
            ax.text(x0 + 0.12, y_out - PAD - (j + 0.5) * LINE_H, line, family=sf.MONO,
                    fontsize=FONT, color=sf.GREY if j in (0, 3) else sf.INK, va="center")
        return sf.save(plt, fig, out, "llama_block.py")


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
