"""Prompt lookup and self-speculative decoding against plain greedy generation.

Usage::

    OPENBLAS_NUM_THREADS=1 python scripts/lookup_speedup.py -r 3 --backend reference

Runs ``llamaref generate``, ``llamaref lookup`` and ``llamaref speculative-simple
--draft-layers K`` (the model's own first K layers draft for it, one row per ``--self-spec``
value) on the same prompts, alternating, ``-r`` times each, with greedy sampling on the
default model (SmolLM2-135M-Instruct Q4_1). For each prompt and method it prints the median
generation speed (``generate``: llama_perf's eval tokens/s; the others: their "decoded ...
speed" line, drafting included), the ratio to ``generate``, the acceptance rate, and whether
the text is generate's (it must be: greedy verification checks every drafted token against
the model's own argmax).

The prompts repeat material the answer copies (a paragraph to copy, code to edit), where
lookup can draft: that is what it is for. A prompt the model does not repeat gains nothing.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COPY = """<|im_start|>user
Copy this paragraph exactly, word for word:

The city council met on Tuesday to discuss the new bus routes. After a long debate, the \
members agreed to add two lines to the northern districts, to run the buses every ten \
minutes during rush hour, and to review the plan again in six months.<|im_end|>
<|im_start|>assistant
"""

CODE = """<|im_start|>user
Rewrite this function with `values` renamed to `samples`. Reply with the code only.

def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result<|im_end|>
<|im_start|>assistant
"""

PROMPTS = {"copy a paragraph": COPY, "edit code": CODE}


def run(argv: list[str]) -> tuple[str, str]:
    """``llamaref ARGV``: its stdout and stderr."""
    out = subprocess.run([sys.executable, "-m", "llamaref.cli", *argv], capture_output=True,
                         text=True, check=True)
    return out.stdout, out.stderr


def speed_of(err: str) -> float:
    """The "decoded N tokens in T seconds, speed: S t/s" line of lookup / speculative."""
    return float(re.search(r"decoded .* speed: +([\d.]+) t/s", err)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-n", type=int, default=64, help="tokens to generate")
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--self-spec", default="10,20",
                   help="draft layers of the self-speculative rows (comma-separated; '' none)")
    p.add_argument("--backend", default="reference", choices=("reference", "accelerated"))
    args = p.parse_args()
    common = ["-n", str(args.n), "--temp", "0", "--backend", args.backend]
    methods = {"lookup": ["lookup", "--draft-max", str(args.draft_max)]}
    for k in filter(None, args.self_spec.split(",")):
        methods[f"self-speculative, {k} layers"] = [
            "speculative-simple", "--draft-layers", k, "--draft-max", str(args.draft_max)]
    print("| prompt | method | generate t/s | method t/s | speedup | accept | same text |\n"
          "|---|---|---:|---:|---:|---:|---|")
    for name, prompt in PROMPTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "prompt.txt"
            path.write_text(prompt)
            gen, speeds = [], {m: [] for m in methods}
            accept, same = {}, {m: True for m in methods}
            for _ in range(args.repetitions):
                out_g, err_g = run(["generate", prompt, *common])
                gen.append(float(re.findall(r"eval time =.*?([\d.]+) tokens per second",
                                            err_g)[-1]))
                for m, argv in methods.items():
                    out, err = run([argv[0], "-f", str(path), *common, *argv[1:]])
                    speeds[m].append(speed_of(err))
                    accept[m] = re.search(r"accept += ([\d.]+%)", err)[1]
                    same[m] &= out_g.strip() == out.strip()
        g = statistics.median(gen)
        for m in methods:
            s = statistics.median(speeds[m])
            print(f"| {name} | {m} | {g:.1f} | {s:.1f} | {s / g:.2f} | {accept[m]} | "
                  f"{same[m]} |", flush=True)


if __name__ == "__main__":
    main()
