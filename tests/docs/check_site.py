"""Fail when a built page still shows a raw code fence or a snippet marker, and more.

A raw fence means a block did not render (a bad fence attribute); a snippet marker means an
include did not resolve. Both would be silent in ``mkdocs build``. Two more static checks:
no page is built from a file under ``assets/`` (an include such as a bench table must be
excluded with ``exclude_docs``, or it becomes an untitled page in the search), and a page
shows the text it exists to show (``EXPECTED``). Run after the build:
``python tests/docs/check_site.py site``; ``tests/docs/check_site_browser.py`` then looks at
the pages in a browser.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PATTERNS = {
    "raw code fence": re.compile(r"^\s*(```|~~~)", re.MULTILINE),
    "snippet marker": re.compile(r"--8&lt;--|--8<--"),
}


# Text (as in the HTML) that a page must show: the conventions page's example of the two
# snippet markers, which the snippets extension strips unless each is escaped with a ";".
EXPECTED = {
    "conventions/index.html": ["# --8&lt;-- [start:rms_norm]", "# --8&lt;-- [end:rms_norm]"],
}


# (page, picture, what it must come before): the cells chapter once showed its only picture,
# as text art, 6,900 px down after 737 lines of source; a reader sees the picture first now.
BEFORE = [
    ("memory/cells/index.html", "kv_cells.svg", "<pre"),
]


def problems(site: Path) -> list[str]:
    """Every (page, kind) where the built HTML shows something that should have rendered."""
    found = []
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        # The search index and source listings are not prose; a fence inside <code> is code.
        prose = re.sub(r"<pre.*?</pre>|<code.*?</code>", "", text, flags=re.DOTALL)
        for kind, pattern in PATTERNS.items():
            if pattern.search(prose):
                found.append(f"{page.relative_to(site)}: {kind}")
    for page in sorted((site / "assets").rglob("*.html")):
        found.append(f"{page.relative_to(site)}: a page built from an asset (exclude_docs)")
    for name, picture, later in BEFORE:
        text = (site / name).read_text(encoding="utf-8") if (site / name).exists() else ""
        at, first = text.find(picture), text.find(later)
        if at < 0 or (first >= 0 and first < at):
            found.append(f"{name}: {picture} is not shown before the first {later!r}")
    for name, texts in EXPECTED.items():
        text = (site / name).read_text(encoding="utf-8") if (site / name).exists() else ""
        found += [f"{name}: does not show {t!r}" for t in texts if t not in text]
    return found


if __name__ == "__main__":
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "site")
    bad = problems(site)
    print("\n".join(bad) if bad else f"site check: {site} is clean")
    sys.exit(1 if bad else 0)
