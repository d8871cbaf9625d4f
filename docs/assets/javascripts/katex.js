// Render the math that pymdownx.arithmatex (generic mode) leaves in .arithmatex elements.
// KaTeX is served from the repository (docs/assets/katex), so the site works offline.
function renderMath() {
  for (const el of document.querySelectorAll(".arithmatex")) {
    renderMathInElement(el, {
      delimiters: [
        { left: "$$", right: "$$", display: true },
        { left: "$", right: "$", display: false },
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
    });
  }
  // tests/check_site_browser.py waits for this before it looks at the page.
  document.documentElement.dataset.mathRendered = "true";
}
if (typeof document$ !== "undefined") {
  document$.subscribe(renderMath);  // Material's instant navigation
} else {
  document.addEventListener("DOMContentLoaded", renderMath);
}
