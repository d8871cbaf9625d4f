"""Write the API reference: one page per module under ``docs/api/``, an index, and the nav.

Run after adding, moving or removing a module::

    python scripts/api_pages.py

and commit what changed. ``tests/docs/test_api.py`` fails when a page, the index or the nav
block of ``mkdocs.yml`` differs from what this script writes, so no module can be missing from
the reference and no page can outlive its module.

Why one page per module: a single page of every docstring with its source was 9.9 MB and took
seconds to open. Why generated: the list of modules is the packages themselves, so it is read
from the file tree instead of typed by hand.

The pages carry ``search: boost`` below 1, so a search for a name lists the chapter that
explains it before the page that lists its source.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["reference", "accelerated", "llamaref"]
API_DIR = ROOT / "docs" / "api"
MKDOCS = ROOT / "mkdocs.yml"
NAV_START = "  # api-nav: start (written by scripts/api_pages.py)"
NAV_END = "  # api-nav: end"
SEARCH_BOOST = 0.25

# What each package is, for the index (bottom layer first, as in docs/architecture.md).
LAYERS = {
    "reference": "the specification, in NumPy",
    "accelerated": "the MLX twin",
    "llamaref": "the application",
}


def modules() -> list[str]:
    """Every module of our three packages, by dotted name, packages before their modules."""
    names = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if any(p.startswith("_") for p in parts):
                continue
            names.append(".".join(parts))
    return sorted(names, key=lambda n: (PACKAGES.index(n.split(".")[0]), n.split(".")))


def summary(module: str) -> str:
    """The first sentence-line of a module's docstring ('' if it has none)."""
    doc = ast.get_docstring(ast.parse(source(module).read_text())) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def source(module: str) -> Path:
    """The file of a module or package."""
    rel = Path(*module.split("."))
    path = ROOT / rel.with_suffix(".py")
    return path if path.exists() else ROOT / rel / "__init__.py"


def own_members(module: str) -> list[str]:
    """The public names a file defines itself (not what it imports)."""
    names = []
    for node in ast.parse(source(module).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_")]


def page(module: str) -> str:
    """One module's page: the module's docstring and members, its heading the page title.

    A package's ``__init__`` re-exports its modules' names; those have their own pages, so a
    package page shows only what its ``__init__`` defines.
    """
    options = ["      heading_level: 1", "      show_root_full_path: true"]
    if source(module).name == "__init__.py":
        own = own_members(module)
        options.append(f"      members: [{', '.join(own)}]" if own else "      members: false")
    return (
        f"---\nsearch:\n  boost: {SEARCH_BOOST}\n---\n\n"
        f"::: {module}\n"
        "    options:\n" + "\n".join(options) + "\n"
    )


def index() -> str:
    """The index: every module, by package, with the first line of its docstring."""
    out = [
        "# API",
        "",
        "One page per module, from the docstrings, layer by layer from the bottom up",
        "([Architecture](../architecture.md)). The chapters explain; these pages list.",
        "",
    ]
    for pkg in PACKAGES:
        # the api-index class keeps module names on one line (extra.css)
        out += [f"## `{pkg}`: {LAYERS[pkg]}", "", '<div class="api-index" markdown>', "",
                "| module | what it is |", "|---|---|"]
        for m in modules():
            if m.split(".")[0] == pkg:
                text = summary(m).replace("|", "\\|")
                out.append(f"| [`{m}`]({m}.md) | {text} |")
        out += ["", "</div>", ""]
    return "\n".join(out)


def nav() -> str:
    """The API section of the nav, between its two marker comments."""
    out = [NAV_START, "  - API:", "      - api/index.md"]
    for pkg in PACKAGES:
        out.append(f"      - {pkg}:")
        for m in modules():
            if m.split(".")[0] == pkg:
                out.append(f"          - {m}: api/{m}.md")
    out.append(NAV_END)
    return "\n".join(out)


def mkdocs_with_nav(text: str) -> str:
    """mkdocs.yml with its API nav block replaced by the current one."""
    head, sep, rest = text.partition(NAV_START)
    if not sep:
        raise SystemExit(f"mkdocs.yml has no line {NAV_START!r}")
    _, sep, tail = rest.partition(NAV_END)
    if not sep:
        raise SystemExit(f"mkdocs.yml has no line {NAV_END!r}")
    return head + nav() + tail


def expected() -> dict[Path, str]:
    """Every file this script owns, with the text it should have."""
    files = {API_DIR / "index.md": index()}
    for m in modules():
        files[API_DIR / f"{m}.md"] = page(m)
    files[MKDOCS] = mkdocs_with_nav(MKDOCS.read_text())
    return files


def main() -> int:
    files = expected()
    for old in API_DIR.glob("*.md"):
        if old not in files:
            old.unlink()
            print(f"removed {old.relative_to(ROOT)}")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
