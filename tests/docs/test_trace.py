"""The page "One token, end to end" (``docs/trace.md``) against the decode it traces.

``docs/figures/trace.py`` decodes "The capital of France is" with SmolLM2-135M-Instruct Q4_1
on the reference, step by step, and writes what each step printed as a fragment under
``docs/assets/trace/``; the page includes them. Here the script runs again into a temporary
folder: every fragment must equal the committed one (a change to the tokenizer, the batch,
the memory, the model or the sampler that changes a printed value fails until the fragments
are written again), no fragment may be left over, and greedy decoding must say " Paris".
The script itself asserts that its hand-made decode equals ``Context.decode`` bit for bit.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from reference.model_loader import ModelLoadError, default_model_path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
COMMITTED = DOCS / "assets" / "trace"


def load_script():
    """``docs/figures/trace.py`` as a module (``docs/figures`` is not a package)."""
    spec = importlib.util.spec_from_file_location("docs_figures_trace",
                                                  DOCS / "figures" / "trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    try:
        default_model_path()
    except ModelLoadError as e:  # the default model is not installed
        pytest.skip(str(e))
    return load_script().write(tmp_path_factory.mktemp("trace"))


def test_fragments_are_current(written):
    committed = {p.stem: p for p in COMMITTED.glob("*.md")}
    assert sorted(committed) == sorted(written), (
        "docs/assets/trace/ holds other fragments than docs/figures/trace.py writes: "
        "run python docs/figures/trace.py and commit its output")
    stale = [name for name, path in written.items()
             if path.read_text() != committed[name].read_text()]
    assert not stale, (f"stale fragments {stale}: run python docs/figures/trace.py and "
                       f"commit docs/assets/trace/")


def test_greedy_says_paris(written):
    assert "greedy: 7042 ' Paris'" in written["greedy"].read_text()
    assert "'The capital of France is Paris'" in written["text"].read_text()


def test_page_shows_every_step():
    """Each fragment is included by the page, after the code section of the same name."""
    page = (DOCS / "trace.md").read_text()
    script = (DOCS / "figures" / "trace.py").read_text()
    sections = re.findall(r"# --8<-- \[start:(\w+)\]", script)
    for name in sorted(p.stem for p in COMMITTED.glob("*.md")):
        code = f'--8<-- "docs/figures/trace.py:{name}"'
        out = f'--8<-- "docs/assets/trace/{name}.md"'
        assert name in sections, f"trace.py has no section {name!r}"
        assert code in page and out in page, f"docs/trace.md does not show step {name!r}"
        assert page.index(code) < page.index(out), f"step {name!r}: output before code"
