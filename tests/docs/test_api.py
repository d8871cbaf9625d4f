"""The API reference is one page per module, written by ``scripts/api_pages.py``.

These tests fail when a module has no page, a page outlives its module, or the nav block of
``mkdocs.yml`` is stale (run the script and commit), and when a docstring uses a Sphinx role,
which mkdocstrings prints literally (write ``[`name`][]`` or ``[`text`][full.path]``).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("api_pages", ROOT / "scripts" / "api_pages.py")
api_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(api_pages)

SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const|ref):`")


def test_every_module_has_its_page_and_nothing_else():
    expected = api_pages.expected()
    stale = [str(p.relative_to(ROOT)) for p, text in expected.items()
             if not p.exists() or p.read_text() != text]
    extra = [str(p.relative_to(ROOT)) for p in api_pages.API_DIR.glob("*.md") if p not in expected]
    assert not stale and not extra, (
        f"stale or missing: {stale}; without a module: {extra}; run python scripts/api_pages.py")


def test_a_page_per_module_of_each_package():
    mods = api_pages.modules()
    for must in ["reference.context", "reference.ops.rope", "accelerated.context", "llamaref.cli"]:
        assert must in mods
    assert len(mods) == len(set(mods))


@pytest.mark.parametrize("package", ["reference", "accelerated", "llamaref", "scripts", "docs"])
def test_no_sphinx_roles(package):
    hits = []
    for path in sorted((ROOT / package).rglob("*")):
        if path.suffix not in {".py", ".md"}:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if SPHINX_ROLE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "Sphinx roles print literally on the site:\n" + "\n".join(hits)
