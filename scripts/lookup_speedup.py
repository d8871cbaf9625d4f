"""Prompt-lookup decoding against plain greedy generation: tokens/s and identical text.

Usage::

    OPENBLAS_NUM_THREADS=1 python scripts/lookup_speedup.py -r 3 --backend reference

Runs ``llamaref generate`` and ``llamaref lookup`` on the same prompts, alternating, ``-r``
times each, with greedy sampling on the default model (SmolLM2-135M-Instruct Q4_1). For each
prompt it prints the median generation speed of both (``generate``: llama_perf's eval
tokens/s; ``lookup``: its "decoded ... speed" line, drafting included), the ratio, the
acceptance rate, and whether the two texts are the same (they must be: greedy lookup
verifies every drafted token against the model's own argmax).

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-n", type=int, default=64, help="tokens to generate")
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--backend", default="reference", choices=("reference", "accelerated"))
    args = p.parse_args()
    common = ["-n", str(args.n), "--temp", "0", "--backend", args.backend]
    print("| prompt | generate t/s | lookup t/s | speedup | accept | same text |\n"
          "|---|---:|---:|---:|---:|---|")
    for name, prompt in PROMPTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "prompt.txt"
            path.write_text(prompt)
            gen, look, accept, same = [], [], "", True
            for _ in range(args.repetitions):
                out_g, err_g = run(["generate", prompt, *common])
                gen.append(float(re.findall(r"eval time =.*?([\d.]+) tokens per second",
                                            err_g)[-1]))
                out_l, err_l = run(["lookup", "-f", str(path), *common,
                                    "--draft-max", str(args.draft_max)])
                look.append(float(re.search(r"decoded .* speed: +([\d.]+) t/s", err_l)[1]))
                accept = re.search(r"accept += ([\d.]+%)", err_l)[1]
                same &= out_g.strip() == out_l.strip()
        g, lk = statistics.median(gen), statistics.median(look)
        print(f"| {name} | {g:.1f} | {lk:.1f} | {lk / g:.2f} | {accept} | {same} |",
              flush=True)


if __name__ == "__main__":
    main()
