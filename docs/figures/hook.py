"""MkDocs hook: draw the pictures under ``docs/assets/figures/`` before every build.

Registered in ``mkdocs.yml`` (``hooks:``). Before each build (``mkdocs build``, and every
rebuild of ``mkdocs serve``) it runs the ``draw`` function of every script named in
``FIGURES`` into a temporary folder and copies a picture into ``docs/assets/figures/`` only
when its bytes changed: the drawing is deterministic, so an unchanged picture is not
touched and ``mkdocs serve`` does not see a change it would rebuild for. A changed picture is
a change to commit; ``tests/docs/test_figures.py`` fails until it is committed.

The pictures are drawn from the code (a real forward, a real cache, the real splits, sampler
chain and RoPE functions), so they need ``matplotlib`` beside the docs tools.
"""

from __future__ import annotations

import importlib.util
import logging
import tempfile
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE.parents[1] / "docs" / "assets" / "figures"
# the scripts of docs/figures/ that draw a picture: <name>.py writes <name>.svg
FIGURES = ["layers", "llama_block", "kv_cells", "ubatch_splits", "sampler_chain", "rope_pairs",
           "iswa"]

log = logging.getLogger("mkdocs.hooks.figures")


def load(name: str) -> ModuleType:
    """The script ``docs/figures/<name>.py`` as a module (``docs/figures`` is no package)."""
    spec = importlib.util.spec_from_file_location(f"docs_figures_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if Path(module.OUT).name != f"{name}.svg":
        raise RuntimeError(f"docs/figures/{name}.py writes {module.OUT}, not {name}.svg")
    return module


def build_figures(folder: Path = OUT_DIR) -> list[Path]:
    """Draw every picture of ``FIGURES``; write into ``folder`` those whose bytes changed.

    Returns:
        The files written (none when every picture was already up to date).
    """
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in FIGURES:
            new = load(name).draw(Path(tmp) / f"{name}.svg").read_bytes()
            target = folder / f"{name}.svg"
            if target.exists() and target.read_bytes() == new:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(new)
            written.append(target)
    return written


def on_pre_build(config, **kwargs) -> None:
    """MkDocs' ``on_pre_build`` event: the pictures, before the pages that show them."""
    for path in build_figures():
        log.info("figure redrawn from the code: %s (commit it)",
                 path.relative_to(OUT_DIR.parents[2]))
