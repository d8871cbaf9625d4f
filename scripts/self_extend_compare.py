"""llama.cpp's Self-Extend against the paper's, measured on SmolLM2-135M.

Usage::

    python scripts/self_extend_compare.py --lengths 256,512,1024 --g 4 --w 64 --last 32

For a prompt of ``L`` tokens (the passkey text), the logits of its last ``--last`` tokens are
computed four ways on the reference (float64, the GGUF dequantized), each query decoded after
what precedes it:

- **exact**: ordinary attention, every token at its own position;
- **cache, ours**: ``llama-completion``'s loop (``--grp-attn-n G --grp-attn-w W``) on our
  cache, one token per decode after the prompt's first ``L - last`` tokens;
- **cache, llama.cpp's sign**: the same with ``seq_div`` recording llama.cpp's shift
  (``pos_div_shift_llamacpp``): what llama.cpp itself computes;
- **paper**: [`self_extend_forward`] with neighbour window ``W_n = W``.

Each pair is compared by NMSE over the rows and by the agreement of their argmax. The table
goes to ``docs/assets/self-extend/compare.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import reference.memory.kv_cells as kv_cells  # noqa: E402
from reference.batch import Batch  # noqa: E402
from reference.context import Context  # noqa: E402
from reference.model_loader import default_model_path, load_model  # noqa: E402
from reference.testing import nmse  # noqa: E402
from reference.tokenizer import load_tokenizer  # noqa: E402
from reference.tools.generate import Generator  # noqa: E402
from reference.tools.passkey import passkey_prompt  # noqa: E402
from reference.tools.self_extend import self_extend_forward  # noqa: E402

OUT = REPO / "docs" / "assets" / "self-extend"


class _Keep:
    def accept(self, token):
        pass


def cache_rows(hp, w, tokens, g, w_blk, last, llamacpp_sign=False):
    """Rows of the last ``last`` tokens, each decoded alone after the grouping loop."""
    saved = kv_cells.pos_div_shift
    if llamacpp_sign:
        kv_cells.pos_div_shift = kv_cells.pos_div_shift_llamacpp
    try:
        ctx = Context(hp, w, n_ctx=len(tokens) + 64, n_batch=512, dtype=np.float64)
        gen = Generator(ctx, _Keep(), shift=False, ga_n=g, ga_w=w_blk)
        gen.eval_prompt(tokens[:-last])
        rows = []
        for t in tokens[-last:]:
            gen.eval_prompt([t])
            rows.append(ctx.get_logits_ith(-1).copy())
        return np.array(rows)  # (last, n_vocab)
    finally:
        kv_cells.pos_div_shift = saved


def exact_rows(hp, w, tokens, last):
    ctx = Context(hp, w, n_ctx=len(tokens) + 64, n_batch=len(tokens), dtype=np.float64)
    n = len(tokens)
    assert ctx.decode(Batch(token=tokens, logits=[i >= n - last for i in range(n)])) == 0
    return ctx.get_logits().copy()  # (last, n_vocab)


def agree(a, b) -> float:
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,512,1024")
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--w", type=int, default=64)
    ap.add_argument("--last", type=int, default=32)
    args = ap.parse_args(argv)
    path = default_model_path()
    hp, w = load_model(path)
    tok = load_tokenizer(path)
    text = tok.tokenize(passkey_prompt(400, 7, 39384), add_special=True)
    lines = [f"G = {args.g}, W = W_n = {args.w}; the last {args.last} tokens of each prompt; "
             "NMSE of the logits rows / argmax agreement.", "",
             "| L | cache (ours) vs exact | cache (llama.cpp's sign) vs exact | paper vs exact "
             "| cache (ours) vs paper |", "|---:|---|---|---|---|"]
    for length in map(int, args.lengths.split(",")):
        tokens = [int(t) for t in text[:length]]
        ex = exact_rows(hp, w, tokens, args.last)
        ours = cache_rows(hp, w, tokens, args.g, args.w, args.last)
        sign = cache_rows(hp, w, tokens, args.g, args.w, args.last, llamacpp_sign=True)
        paper = self_extend_forward(w, hp, np.array(tokens), args.g, args.w)[-args.last:]
        cells = [f"{nmse(b, a):.2e} / {agree(a, b):.2f}"
                 for a, b in ((ex, ours), (ex, sign), (ex, paper), (paper, ours))]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "compare.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
