"""Write the map of names, ``docs/assets/map/table.md``, from ``reference/surface.py``.

Run from anywhere, after changing the table in ``reference/surface.py``, a chapter's headings
or the nav labels of ``mkdocs.yml``::

    python docs/figures/map.py

and commit the fragment. ``docs/map.md`` includes it (snippets), and
``tests/docs/test_surface_map.py`` fails when the committed fragment differs from what this script
writes now. One table per kind of llama.cpp name, in the order of ``KINDS``; each row links
our name to its API entry (when the entry has a docstring, so that the API page shows it) and
the chapter to its page and section, named by the nav label and the section's heading.
"""

from __future__ import annotations

import html
import importlib
import inspect
import re
import sys
from functools import cache
from pathlib import Path

import markdown
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
OUT = DOCS / "assets" / "map" / "table.md"
if str(ROOT) not in sys.path:  # run as a script: reference/ is beside docs/
    sys.path.insert(0, str(ROOT))

from reference.surface import KINDS, SURFACE, Entry  # noqa: E402

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_:]*")  # a C or C++ name, shown as code


def resolve(ours: str) -> tuple[str, object]:
    """``(module, object)`` of a full dotted name: the longest prefix that imports, then getattr.

    Raises:
        ImportError, AttributeError: when the name does not resolve.
    """
    parts = ours.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = inspect.getattr_static(obj, attr)
            if isinstance(obj, staticmethod | classmethod):
                obj = obj.__func__
        return module, obj
    raise ImportError(f"no module in {ours!r}")


def documented(obj: object) -> bool:
    """Whether the API page shows ``obj`` (it hides what has no docstring): a class, function
    or property with its own docstring. Constants are not linked (their docstring is not
    visible at run time)."""
    if isinstance(obj, property):
        return bool(obj.fget and obj.fget.__doc__)
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return bool(obj.__doc__)
    return False


@cache
def nav_labels() -> dict[str, str]:
    """``page path -> its label in the nav`` of ``mkdocs.yml``."""
    labels: dict[str, str] = {}

    def walk(items: list) -> None:
        for item in items:
            if isinstance(item, dict):
                for label, value in item.items():
                    if isinstance(value, str):
                        labels[value] = label
                    else:
                        walk(value)

    walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    return labels


@cache
def headings(page: str) -> dict[str, str]:
    """``anchor -> heading text`` of a page under ``docs/``, as the site's toc computes them."""
    md = markdown.Markdown(extensions=["toc", "attr_list", "tables", "md_in_html",
                                       "pymdownx.superfences"])
    md.convert((DOCS / page).read_text())
    out: dict[str, str] = {}

    def walk(tokens: list) -> None:
        for t in tokens:
            out[t["id"]] = html_to_markdown(t["html"])
            walk(t["children"])

    walk(md.toc_tokens)
    return out


def html_to_markdown(text: str) -> str:
    """A heading's inline HTML back to Markdown: code stays code, other tags go."""
    text = re.sub(r"</?code>", "`", text)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


def llama_cell(e: Entry) -> str:
    """The llama.cpp name: code when it is a name, text when it describes (``context shift``)."""
    return f"`{e.llama}`" if IDENTIFIER.fullmatch(e.llama) else e.llama


def ours_cell(e: Entry) -> str:
    """Our name without its module, linked to its API entry when the API page shows one."""
    module, obj = resolve(e.ours)
    short = e.ours[len(module) + 1:] or e.ours
    return f"[`{short}`][{e.ours}]" if documented(obj) else f"`{short}`"


def chapter_cell(e: Entry) -> str:
    """A link to the chapter (``map.md`` is in ``docs/``): nav label, then the section."""
    page, _, anchor = e.chapter.partition("#")
    text = nav_labels().get(page, page)
    if anchor:
        text += " › " + headings(page)[anchor]
    return f"[{text}]({e.chapter})"


def render() -> str:
    """The fragment: one section and one table per kind."""
    out = [
        "<!-- written by docs/figures/map.py from reference/surface.py: do not edit -->",
        "",
    ]
    for kind, title in KINDS.items():
        rows = [e for e in SURFACE if e.kind == kind]
        out += [f"## {title}", "", '<div class="map-table" markdown>', "",
                "| llama.cpp | ours | explained in | note |", "|---|---|---|---|"]
        for e in rows:
            out.append(f"| {llama_cell(e)} | {ours_cell(e)} | {chapter_cell(e)} | {e.note} |")
        out += ["", "</div>", ""]
    return "\n".join(out)


def main() -> int:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    text = render()
    if not OUT.exists() or OUT.read_text() != text:
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
