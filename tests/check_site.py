"""Fail when a built page still shows a raw code fence or a snippet marker.

A raw fence means a block did not render (a bad fence attribute); a snippet marker means an
include did not resolve. Both would be silent in ``mkdocs build``. Run after the build:
``python tests/check_site.py site``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PATTERNS = {
    "raw code fence": re.compile(r"^\s*(```|~~~)", re.MULTILINE),
    "snippet marker": re.compile(r"--8&lt;--|--8<--"),
}


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
    return found


if __name__ == "__main__":
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "site")
    bad = problems(site)
    print("\n".join(bad) if bad else f"site check: {site} is clean")
    sys.exit(1 if bad else 0)
