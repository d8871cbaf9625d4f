"""Load every built page in headless Chromium and fail on what a reader would see broken.

Run after the build: ``python tests/docs/check_site_browser.py site``. The script serves the built
site on localhost, opens each ``*.html`` page at 1400 px wide in Chromium (Debian's
``/usr/bin/chromium``, driven by Playwright, with a fresh profile and no network beyond
localhost), waits for KaTeX to render the math, and then looks at the page as rendered:

- **raw math**: ``$$`` or ``$...$`` left in the text, a ``.arithmatex`` element KaTeX did not
  render, or a KaTeX parse error (``.katex-error``);
- **raw table pipes**: a line of prose that starts with ``|`` (a table that did not parse);
- **Sphinx role**: ``:func:``, ``:class:``, ``:meth:`` ... printed literally;
- **raw code fence**: a line of prose that starts with a fence, or a fence line inside a code
  block that is not Markdown (a fence closed with text after it swallows the next paragraph);
- **wide table**, **wide formula**: a table or a KaTeX display wider than the content column;
- **wide code**: a code block that scrolls although its longest line is within the
  100-character limit of ``ruff`` (the column is sized so such a line fits: see
  ``docs/assets/stylesheets/extra.css``). Blocks with longer lines (shell commands, program
  output) may scroll;
- **failed request**: a request that fails or answers 400 or more (image, font, script), and an
  uncaught script error;
- **page size**: an HTML page over 2 MB;
- **squeezed column**: code in a table cell broken into lines of a few letters each;
- **unused image**: a picture under ``assets/bench/`` or ``assets/figures/`` that no page loads.

Text inside code, KaTeX output and the source listings is not prose and is not searched.
Screenshots of the key pages are written to ``site/_screenshots/`` (the top
``SCREENSHOT_HEIGHT`` pixels of each page).

``KNOWN`` lists the (page, defect) pairs that fail today on purpose. It may only shrink: a known
pair that no longer fails is an error too, so that whoever fixes it also removes it here.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.server
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

WIDTH, HEIGHT = 1400, 900
MAX_PAGE_BYTES = 2_000_000
CODE_LINE_LIMIT = 100  # [tool.ruff] line-length in pyproject.toml
SCREENSHOT_HEIGHT = 16000  # px: Chromium draws at most 16384 px in one screenshot
SCREENSHOTS = {
    "index.html": "home",
    "architecture/index.html": "architecture",
    "conventions/index.html": "conventions",
    "trace/index.html": "trace",
    "memory/cells/index.html": "memory-cells",
    "decode/index.html": "decode",
    "sampling/index.html": "sampling",
    "performance/index.html": "performance",
    "map/index.html": "map",
    "api/index.html": "api",
    "api/reference.context/index.html": "api-reference-context",
}
# Pictures written into docs/ by a script (llamaref bench --plot, docs/figures/): each must be
# shown by some page, or it is a leftover.
IMAGE_FOLDERS = ["assets/bench", "assets/figures"]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# (page, defect kind) pairs that are known to fail, with the reason. Shrink only.
KNOWN: dict[tuple[str, str], str] = {}

# Runs in the page: every defect as [kind, detail]. `col` is the content column.
PAGE_SCRIPT = r"""
() => {
  const col = document.querySelector("article.md-content__inner") || document.body;
  const cs = getComputedStyle(col);
  const colWidth = col.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
  const found = [];
  const short = (s) => s.replace(/\s+/g, " ").trim().slice(0, 90);
  const where = (el) => {  // the nearest heading above el, to say where a defect is
    for (let n = el; n && n !== col; n = n.parentElement) {
      for (let h = n.previousElementSibling; h; h = h.previousElementSibling) {
        if (/^H[1-6]$/.test(h.tagName)) {
          return "\u00a7 " + short(h.textContent.replace("\u00b6", ""));
        }
      }
    }
    return "top";
  };

  // Prose: the text of each block, with code, math and nested blocks left out.
  const SKIP = "pre, code, kbd, samp, script, style, svg, .katex, .katex-display, .arithmatex, "
    + ".doc-source, details.quote";
  const BLOCK = /^(P|LI|TD|TH|H[1-6]|DT|DD|FIGCAPTION|SUMMARY)$/;
  const NESTED = /^(P|UL|OL|LI|TABLE|DIV|PRE|BLOCKQUOTE|DL|DETAILS|FIGURE)$/;
  const text = (el) => {
    let s = "";
    for (const c of el.childNodes) {
      if (c.nodeType === 3) s += c.data;
      else if (c.nodeType === 1) {
        if (c.matches(SKIP)) s += "\u2022";
        else if (!NESTED.test(c.tagName)) s += text(c);
      }
    }
    return s;
  };
  const rules = [
    ["raw math", /\$\$|(^|[^\\\w$])\$[^\s$][^$\n]*\$/],
    ["raw table pipes", /(^|\n)[ \t]*\|[^\n]*\|/],
    ["Sphinx role",
     /:(func|class|meth|mod|data|attr|exc|obj|const|ref|doc|term|py:\w+):(`|\u2022)/],
    ["raw code fence", /(^|\n)[ \t]*(```|~~~)/],
  ];
  for (const el of col.querySelectorAll("*")) {
    if (!BLOCK.test(el.tagName) || el.closest(SKIP)) continue;
    const t = text(el);
    for (const [kind, re] of rules) {
      const m = t.match(re);
      if (m) {
        const i = Math.max(0, m.index - 20);
        found.push([kind, where(el) + ": \u2026" + short(t.slice(i, i + 80)) + "\u2026"]);
      }
    }
  }
  for (const el of col.querySelectorAll(".arithmatex")) {
    if (!el.querySelector(".katex")) {
      found.push(["raw math", `${where(el)}: not rendered: ${short(el.textContent)}`]);
    }
  }
  for (const el of col.querySelectorAll(".katex-error")) {
    found.push(["raw math", where(el) + ": KaTeX error: " + short(el.title || el.textContent)]);
  }

  // A fence line inside a code block that is not itself Markdown.
  for (const el of col.querySelectorAll("pre > code")) {
    const md = el.closest(".language-markdown, .language-md, .language-text");
    if (!md && /(^|\n)\s*(```|~~~)/.test(el.textContent)) {
      found.push(["raw code fence", where(el) + ": fence inside a code block"]);
    }
  }

  // Widths. Tables sit in Material's scroll wrapper; displays centre inside .katex-display.
  const px = (w) => `${Math.round(w)} px in a ${Math.round(colWidth)} px column`;
  for (const el of col.querySelectorAll("table")) {
    if (el.closest(".doc-source")) continue;
    const w = Math.max(el.getBoundingClientRect().width, el.scrollWidth);
    if (w > colWidth + 1) found.push(["wide table", `${where(el)}: ${px(w)}`]);
  }
  for (const el of col.querySelectorAll(".katex-display")) {
    const w = el.scrollWidth, inner = el.querySelector(".katex-html");
    const need = Math.max(w, inner ? inner.getBoundingClientRect().width : 0);
    if (need > Math.min(el.clientWidth, colWidth) + 1) {
      found.push(["wide formula", `${where(el)}: ${px(need)}`]);
    }
  }
  for (const el of col.querySelectorAll("pre > code")) {
    if (el.scrollWidth <= el.clientWidth + 1) continue;
    const longest = Math.max(...el.textContent.split("\n").map((l) => l.length));
    if (longest <= LIMIT) {
      const why = `a ${longest}-character line scrolls (${el.scrollWidth} > ${el.clientWidth} px)`;
      found.push(["wide code", `${where(el)}: ${why}`]);
    }
  }
  // A table column squeezed until its words break letter by letter.
  for (const el of col.querySelectorAll("td code, th code")) {
    const lines = el.getClientRects().length, n = el.textContent.length;
    if (lines >= 3 && n / lines < 8) {
      const why = `\`${short(el.textContent)}\` breaks into ${lines} lines`;
      found.push(["squeezed column", `${where(el)}: ${why}`]);
    }
  }
  return {found, colWidth};
}
"""

# docs/assets/javascripts/katex.js sets this once it has rendered every formula of the page.
KATEX_DONE = "() => document.documentElement.dataset.mathRendered === 'true'"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would drown the report
        pass


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    """Serve ``site`` on a free localhost port in a background thread."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def check_page(context, base: str, rel: str, site: Path, shots: Path,
                     requested: set[str]) -> list[tuple]:
    """Open one page; return its defects as (page, kind, detail); add its requests' URLs."""
    page = await context.new_page()
    found: list[tuple[str, str]] = []
    page.on("request", lambda r: requested.add(r.url.removeprefix(base).split("?")[0]))
    page.on("requestfailed", lambda r: found.append(("failed request", f"{r.url}: {r.failure}")))
    page.on("pageerror", lambda e: found.append(("failed request", f"script error: {e}")))

    def response(r):
        if r.status >= 400:
            found.append(("failed request", f"{r.url}: HTTP {r.status}"))

    page.on("response", response)
    size = (site / rel).stat().st_size
    if size > MAX_PAGE_BYTES:
        found.append(("page size", f"{size / 1e6:.1f} MB > {MAX_PAGE_BYTES / 1e6:.0f} MB"))
    url = base + rel.removesuffix("index.html")
    try:
        await page.goto(url, wait_until="load", timeout=120_000)
        try:
            await page.wait_for_function(KATEX_DONE, timeout=30_000, polling=100)
        except Exception:
            found.append(("raw math", "KaTeX did not run (no data-math-rendered) in 30 s"))
        await page.evaluate("document.fonts.ready")
        result = await page.evaluate(PAGE_SCRIPT.replace("LIMIT", str(CODE_LINE_LIMIT)))
        found += [tuple(f) for f in result["found"]]
        if rel in SCREENSHOTS:
            height = await page.evaluate("document.documentElement.scrollHeight")
            width = page.viewport_size["width"]
            clip = {"x": 0, "y": 0, "width": width, "height": min(height, SCREENSHOT_HEIGHT)}
            await page.screenshot(path=shots / f"{SCREENSHOTS[rel]}.png", clip=clip, full_page=True)
    except Exception as e:  # a page that does not load is a defect, not a crash of the check
        found.append(("failed request", f"{url}: {type(e).__name__}: {e}"))
    finally:
        await page.close()
    return [(rel, kind, detail) for kind, detail in found]


async def check_site(site: Path, jobs: int, width: int = WIDTH) -> list[tuple[str, str, str]]:
    """Every defect of every page under ``site``."""
    from playwright.async_api import async_playwright

    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    shots = site / "_screenshots"
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir()
    server = serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    profile = tempfile.mkdtemp(prefix="check-site-chromium-")
    try:
        async with async_playwright() as pw:
            context = await pw.chromium.launch_persistent_context(
                profile,
                executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                headless=True,
                args=CHROMIUM_FLAGS,
                viewport={"width": width, "height": HEIGHT},
                service_workers="block",
            )
            # Only localhost: a font CDN or any other host is a failed request.
            await context.route(
                lambda url: not url.startswith(base) and not url.startswith("data:"),
                lambda route: route.abort("blockedbyclient"),
            )
            queue: asyncio.Queue[str] = asyncio.Queue()
            for rel in pages:
                queue.put_nowait(rel)
            results: list[tuple[str, str, str]] = []
            requested: set[str] = set()

            async def worker():
                while not queue.empty():
                    rel = queue.get_nowait()
                    results.extend(await check_page(context, base, rel, site, shots, requested))

            await asyncio.gather(*(worker() for _ in range(jobs)))
            await context.close()
    finally:
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    for image in sorted(unused_images(site, requested)):
        results.append(("(site)", "unused image", f"{image}: no page shows it"))
    return sorted(results)


def unused_images(site: Path, requested: set[str]) -> list[str]:
    """The generated pictures (bench plots, figures) that no page loaded."""
    images = []
    for folder in IMAGE_FOLDERS:
        for path in (site / folder).rglob("*"):
            if path.suffix in {".png", ".svg", ".jpg", ".webp"}:
                images.append(path.relative_to(site).as_posix())
    return [image for image in images if image not in requested]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", default="site", type=Path)
    parser.add_argument("-j", "--jobs", type=int, default=3, help="pages open at once")
    parser.add_argument("--width", type=int, default=WIDTH, help="window width in px")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    defects = asyncio.run(check_site(args.site, args.jobs, args.width))
    n_pages = sum(1 for _ in args.site.rglob("*.html"))

    failing = {(page, kind) for page, kind, _ in defects}
    new = [d for d in defects if (d[0], d[1]) not in KNOWN]
    known = [d for d in defects if (d[0], d[1]) in KNOWN]
    fixed = sorted(set(KNOWN) - failing)
    for page, kind, detail in new:
        print(f"{page}: {kind}: {detail}")
    counts: dict[tuple[str, str], int] = {}
    for page, kind, _ in known:
        counts[page, kind] = counts.get((page, kind), 0) + 1
    for (page, kind), n in sorted(counts.items()):
        print(f"known: {page}: {kind} x{n} ({KNOWN[page, kind]})")
    for page, kind in fixed:
        print(f"{page}: {kind}: listed in KNOWN but no longer fails; remove it from KNOWN")
    seconds = time.perf_counter() - start
    verdict = "FAILED" if new or fixed else "clean"
    print(f"browser check: {n_pages} pages in {seconds:.0f} s, {len(new)} new defects, "
          f"{len(known)} known, {verdict}; screenshots in {args.site / '_screenshots'}")
    return 1 if new or fixed else 0


if __name__ == "__main__":
    sys.exit(main())
