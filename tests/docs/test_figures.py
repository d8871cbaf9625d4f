"""The pictures of the site against the code that draws them.

``docs/figures/hook.py`` draws every picture of ``docs/assets/figures/`` from the code before
each docs build (a real forward, a real KV cache, the real splits, sampler chain and RoPE
functions). Here the pictures are drawn again into a temporary folder: each must equal the
committed SVG byte for byte (a change to the code a picture shows, or to the script, fails
until the new picture is committed), a second drawing must write nothing (the hook does not
make ``mkdocs serve`` rebuild forever), every SVG of the folder must come from a script, and
every picture must be shown by some page, with an alt text.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
COMMITTED = DOCS / "assets" / "figures"


def load_hook():
    """``docs/figures/hook.py`` as a module (``docs/figures`` is not a package)."""
    spec = importlib.util.spec_from_file_location("docs_figures_hook",
                                                  DOCS / "figures" / "hook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hook():
    return load_hook()


@pytest.fixture(scope="module")
def drawn(hook, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("figures")
    written = hook.build_figures(folder)
    assert sorted(p.name for p in written) == sorted(f"{n}.svg" for n in hook.FIGURES)
    return folder


def test_figures_are_current(hook, drawn):
    stale = [name for name in hook.FIGURES
             if not (COMMITTED / f"{name}.svg").exists()
             or (drawn / f"{name}.svg").read_bytes() != (COMMITTED / f"{name}.svg").read_bytes()]
    assert not stale, (f"stale pictures {stale}: run mkdocs build (or python "
                       f"docs/figures/<name>.py) and commit docs/assets/figures/")


def test_drawing_again_writes_nothing(hook, drawn):
    assert hook.build_figures(drawn) == []


def test_every_svg_comes_from_a_script(hook):
    svgs = sorted(p.stem for p in COMMITTED.glob("*.svg"))
    assert svgs == sorted(hook.FIGURES), "an SVG in docs/assets/figures/ no script draws"


def test_every_figure_is_shown_with_an_alt_text(hook):
    images = re.compile(r"!\[([^\]]*)\]\(([^)\s]*assets/figures/([\w-]+)\.svg)\)")
    shown: dict[str, list[str]] = {}
    for page in DOCS.rglob("*.md"):
        for alt, _, name in images.findall(page.read_text()):
            shown.setdefault(name, []).append(alt)
    unused = [n for n in hook.FIGURES if n not in shown]
    assert not unused, f"pictures no page shows: {unused}"
    short = {n: alts for n, alts in shown.items() if any(len(a.split()) < 6 for a in alts)}
    assert not short, f"an alt text should say what the picture shows: {short}"
