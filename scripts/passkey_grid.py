"""Passkey retrieval on SmolLM2-135M: ours and llama.cpp's, without and with Self-Extend.

Usage::

    python scripts/passkey_grid.py     # the whole grid: 4k, 8k, 12k, 16k x 5 positions x G 1, 2, 4
    python scripts/passkey_grid.py --lengths 4000,8000 --positions 3 --groups 1,2

For each prompt length (tokens, approximately: ``--junk`` is chosen to reach it), each key
position (``--positions`` evenly spaced junk sentences) and each group size ``G``, the passkey
example ([`reference.tools.passkey.run_passkey`]) runs twice on the same GGUF (SmolLM2-135M-Instruct
Q4_1, ``n_batch`` 2048, so the grouped block is 2048 tokens):

- **ours**: the reference Context (the GGUF dequantized to float32), our ``seq_div``;
- **llama.cpp**: the same loop driving llama.cpp's own context through llama-cpp-python
  (``llamaref/llamacpp.py``: f32 KV cache, no flash attention), so its ``seq_div`` sign
  does what it does.

``G = 1`` runs with a cache that holds the whole prompt at its own positions (positions past
``n_ctx_train`` = 8192 when the prompt is longer), not with ``passkey.cpp``'s shift loop.

Results are appended to ``docs/assets/self-extend/passkey.json`` after every run (a rerun skips
what is there), and the table ``passkey.md`` and the plot ``passkey.svg`` beside it are rewritten.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llamaref.llamacpp import LlamaCppContext  # noqa: E402
from reference.context import Context  # noqa: E402
from reference.model_loader import default_model_path, load_model  # noqa: E402
from reference.tokenizer import load_tokenizer  # noqa: E402
from reference.tools.passkey import passkey_n_ctx, passkey_prompt, run_passkey  # noqa: E402

OUT = REPO / "docs" / "assets" / "self-extend"
N_KEEP, N_BATCH = 32, 2048


def n_junk_for(length: int, tok) -> int:
    """Junk sentences that make a prompt of about ``length`` tokens."""
    per = (len(tok.tokenize(passkey_prompt(101, 0, 12345))) -
           len(tok.tokenize(passkey_prompt(1, 0, 12345)))) / 100
    return max(1, round((length - 60) / per))


def spread_order(n: int) -> list[int]:
    """The key positions ``0 .. n-1`` in the order they run: the middle, the ends, then between.

    A grid takes hours; run in this order, a grid stopped early (and resumed later) already has
    every length and group size at positions spread over the prompt.

    >>> spread_order(5)
    [2, 0, 4, 1, 3]
    """
    order: list[int] = []
    for k in [n // 2, 0, n - 1] + list(range(n)):
        if 0 <= k < n and k not in order:
            order.append(k)
    return order


def run_one(impl: str, hp, weights, tok, path, n_junk: int, i_pos: int, g: int) -> dict:
    n_tokens = len(tok.tokenize(passkey_prompt(n_junk, i_pos, 1)))
    n_ctx = None if g > 1 else max(passkey_n_ctx(hp.n_ctx_train, 1, N_KEEP), n_tokens + 64)
    opened = []

    def new_context(n_ctx: int, n_batch: int):
        if impl == "ours":
            return Context(hp, weights, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=512)
        ctx = LlamaCppContext(path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=512, n_threads=2)
        opened.append(ctx)
        return ctx

    t0 = time.perf_counter()
    try:
        res = run_passkey(new_context, tok, hp.n_ctx_train, n_junk=n_junk, n_keep=N_KEEP,
                          i_pos=i_pos, n_grp=g, n_batch=N_BATCH, n_ctx=n_ctx)
    finally:
        for ctx in opened:
            ctx.close()
    return dict(impl=impl, n_junk=n_junk, i_pos=i_pos, g=g, n_tokens=res.n_tokens_all,
                passkey=res.passkey, answer=res.text, found=res.found,
                seconds=round(time.perf_counter() - t0, 1))


def write_table(results: list[dict]) -> None:
    """``passkey.md``: one row per (length, G), one column per key position (its depth in the
    junk, in percent), each cell ours then llama.cpp (✓ found, ✗ not, · not run yet)."""
    rows: dict = {}
    depths = sorted({round(100 * r["i_pos"] / r["n_junk"]) for r in results})
    for r in results:
        depth = round(100 * r["i_pos"] / r["n_junk"])
        rows.setdefault((r["n_junk"], r["g"]), {}).setdefault(depth, {})[r["impl"]] = r
    head = " | ".join(f"key at {d} %" for d in depths)
    lines = [f"| prompt tokens | G | {head} | found: ours | found: llama.cpp |",
             "|---:|---:|" + ":---:|" * len(depths) + "---:|---:|"]
    for (_n_junk, g), by_depth in sorted(rows.items()):
        n_tok = max(r["n_tokens"] for p in by_depth.values() for r in p.values())
        cells, count = [], {"ours": [0, 0], "llama.cpp": [0, 0]}
        for depth in depths:
            marks = []
            for impl in ("ours", "llama.cpp"):
                r = by_depth.get(depth, {}).get(impl)
                marks.append("·" if r is None else ("✓" if r["found"] else "✗"))
                if r is not None:
                    count[impl][0] += r["found"]
                    count[impl][1] += 1
            cells.append(" ".join(marks))
        ours, theirs = count["ours"], count["llama.cpp"]
        lines.append(f"| {n_tok} | {g} | {' | '.join(cells)} | {ours[0]}/{ours[1]} | "
                     f"{theirs[0]}/{theirs[1]} |")
    (OUT / "passkey.md").write_text("\n".join(lines) + "\n")


def write_plot(results: list[dict]) -> None:
    """``passkey.svg``: per group size, the fraction of key positions found against the prompt
    length, ours and llama.cpp (nudged apart vertically so that equal values stay visible)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r["g"] for r in results})
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.2), sharey=True,
                             squeeze=False)
    styles = {"ours": dict(marker="o", linestyle="-", color="tab:blue"),
              "llama.cpp": dict(marker="x", linestyle="--", color="tab:red")}
    for ax, g in zip(axes[0], groups, strict=True):
        for impl, nudge in (("ours", 0.015), ("llama.cpp", -0.015)):
            by_len: dict = {}
            for r in results:
                if r["impl"] == impl and r["g"] == g:
                    by_len.setdefault(r["n_junk"], []).append(r)
            if not by_len:
                continue
            runs = [rs for _, rs in sorted(by_len.items())]
            xs = [max(r["n_tokens"] for r in rs) for rs in runs]
            ys = [sum(r["found"] for r in rs) / len(rs) + nudge for rs in runs]
            ax.plot(xs, ys, label=impl, **styles[impl])
        ax.axvline(8192, color="grey", linewidth=0.8)
        ax.set_title("no Self-Extend" if g == 1 else f"G = {g}", fontsize=10)
        ax.set_xlabel("prompt tokens")
        ax.set_ylim(-0.08, 1.08)
    axes[0][0].set_ylabel("key positions found")
    axes[0][-1].legend(fontsize=8, loc="center right")  # where no line runs (y = 1/2)
    fig.tight_layout()
    fig.savefig(OUT / "passkey.svg", metadata={"Date": None})
    plt.close(fig)  # the grid redraws after every case: keep one figure, not one per case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4000,8000,12000,16000")
    ap.add_argument("--positions", type=int, default=5)
    ap.add_argument("--groups", default="1,2,4")
    ap.add_argument("--impls", default="ours,llama.cpp")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the table and the plot from passkey.json")
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    store = OUT / "passkey.json"
    results = json.loads(store.read_text()) if store.exists() else []
    if args.render:
        write_table(results)
        write_plot(results)
        return 0
    path = default_model_path()
    hp, weights = load_model(path)
    tok = load_tokenizer(path)
    lengths = [int(n) for n in args.lengths.split(",")]
    junk = {length: n_junk_for(length, tok) for length in lengths}
    for k in spread_order(args.positions):
        for length in lengths:
            n_junk = junk[length]
            i_pos = int((k + 0.5) * n_junk / args.positions)
            for g in map(int, args.groups.split(",")):
                for impl in args.impls.split(","):
                    done = any((r["impl"], r["n_junk"], r["i_pos"], r["g"]) ==
                               (impl, n_junk, i_pos, g) for r in results)
                    if done:
                        continue
                    r = run_one(impl, hp, weights, tok, path, n_junk, i_pos, g)
                    print(json.dumps(r), flush=True)
                    results.append(r)
                    tmp = store.with_suffix(".json.tmp")  # a kill mid-write loses nothing
                    tmp.write_text(json.dumps(results, indent=1) + "\n")
                    tmp.replace(store)
                    write_table(results)
                    write_plot(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
