"""One source of numbers: a measured ratio against a peer is written by ``llamaref bench``.

Pages show measurements by including the tables the bench writes (``docs/assets/bench/``),
never by retyping them: the MLX chapter once said 0.93 of mlx-lm where the performance page,
measured later, said 0.92. Only ``performance.md`` discusses measured ratios in its prose
(each next to its command); every other page includes the table.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PEERS = r"(?:mlx-lm|llama\.cpp|llama-cpp-python)"
# "0.93 of mlx-lm", "1.07× mlx-lm", "at 0.92 against llama.cpp", "mlx-lm's 0.63 ms"
RATIO = re.compile(
    rf"\b\d+\.\d+\s*[×x]?\s*(?:of|against|vs\.?|than|times)?\s*{PEERS}"
    rf"|{PEERS}(?:'s)?\s*(?:at|is|was)?\s*\d+\.\d+\s*(?:[×x]|ms|t/s)"
)
ALLOWED = {"performance.md"}  # the page that explains each figure next to its command


def pages():
    return sorted(p for p in DOCS.rglob("*.md")
                  if "assets" not in p.parts and p.parts[-2] != "api"
                  and str(p.relative_to(DOCS)) not in ALLOWED)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_no_retyped_measurement(page):
    hits = []
    in_fence = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if not in_fence and RATIO.search(line):
            hits.append(f"{n}: {line.strip()}")
    assert not hits, (f"{page.name} retypes a measurement against a peer; include the table "
                      "llamaref bench wrote (docs/assets/bench/) instead:\n" + "\n".join(hits))


def test_the_rule_catches_the_old_defect():
    assert RATIO.search("generation runs at 0.93 of mlx-lm and prompt processing level")
    assert RATIO.search("the twin takes 1.31× mlx-lm's time")
    assert not RATIO.search("mlx-lm 0.32.2 is the peer")
