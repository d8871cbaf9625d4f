"""The site's menu follows one token: the chapters in the order the code meets it.

Issue 11 asked for a reading order that follows one token (conventions, tokenization, batches,
operators, the model, memory, ``llama_decode``, sampling, then MLX) and for a home page that
names the whole path; this holds both to it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH_OF_ONE_TOKEN = [
    "conventions.md", "tokenization.md", "batch.md", "ops/basic.md", "ops/attention.md",
    "quantization.md", "llama.md", "memory/cells.md", "decode.md", "sampling.md", "mlx.md",
]


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's nav, in menu order."""
    nav = ROOT.joinpath("mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    return re.findall(r"^\s*- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", nav, flags=re.MULTILINE)


def test_the_menu_follows_one_token():
    pages = nav_pages()
    missing = [p for p in PATH_OF_ONE_TOKEN if p not in pages]
    assert not missing, f"not in the nav: {missing}"
    order = [pages.index(p) for p in PATH_OF_ONE_TOKEN]
    menu = sorted(PATH_OF_ONE_TOKEN, key=pages.index)
    assert order == sorted(order), "the nav does not follow one token: " + " < ".join(menu)


def test_the_home_page_names_the_path_in_the_same_order():
    home = ROOT.joinpath("docs", "index.md").read_text()
    section = home.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(([\w/.-]+\.md)\)", section)
    firsts = [links.index(p) for p in PATH_OF_ONE_TOKEN]
    assert firsts == sorted(firsts)
