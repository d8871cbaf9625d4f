"""The twin's public surface is the reference's: a static (``ast``) comparison.

For every module ``accelerated/<path>.py`` that has a counterpart ``reference/<path>.py``
(the test grows with the tree), every public name of the reference module must exist in the
twin:

- a public function is either *defined* in the twin, with the same parameter names in the
  same order, the same kinds (positional / keyword-only) and the same defaults (compared as
  source text), and a docstring that starts with "Twin of", or *imported* from that same
  reference module (host-side bookkeeping that is never rewritten, e.g. ``rope_yarn_corr_dims``);
- a public class or constant is defined in the twin or imported from the reference.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TWIN, REF = ROOT / "accelerated", ROOT / "reference"
# The subtrees of accelerated/ whose twins are complete and checked; every module pair found
# under them is compared. Add an entry (e.g. "models", "memory", "quants.py") as a subtree lands.
SCOPE = ("ops", "models", "memory", "context.py", "sampling.py", "training")


def _pairs() -> list[tuple[Path, Path]]:
    pairs = []
    for twin in sorted(TWIN.rglob("*.py")):
        rel = twin.relative_to(TWIN)
        in_scope = rel.parts[0] in SCOPE
        if in_scope and twin.name != "__init__.py" and (REF / rel).exists():
            pairs.append((twin, REF / rel))
    return pairs


PAIRS = _pairs()


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _public(tree: ast.Module) -> dict[str, ast.AST]:
    """Top-level public definitions: functions, classes, assigned constants."""
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return {k: v for k, v in out.items() if not k.startswith("_") and k != "__all__"}


def _imports(tree: ast.Module) -> dict[str, str]:
    """Top-level ``from X import name`` bindings: {bound name: module X}."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if alias.asname in (None, alias.name):
                    out[alias.name] = node.module
    return out


def _signature(fn: ast.FunctionDef) -> list[tuple[str, str, str | None]]:
    """(kind, name, default source) for every parameter, in order."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    sig = [("pos", p.arg, d) for p, d in zip(positional, defaults, strict=True)]
    if a.vararg:
        sig.append(("*", a.vararg.arg, None))
    sig += [("kw", p.arg, None if d is None else ast.unparse(d))
            for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        sig.append(("**", a.kwarg.arg, None))
    return sig


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_there_are_module_pairs():
    """The ops twins at least; the list grows as ``accelerated/`` does."""
    names = {_module_name(t) for t, _ in PAIRS}
    assert {f"accelerated.ops.{m}" for m in
            ("matmul", "rows", "elementwise", "norm", "ffn", "rope", "attention", "ssm")} <= names


@pytest.mark.parametrize("twin, ref", PAIRS, ids=[_module_name(t) for t, _ in PAIRS])
def test_public_surface_matches(twin: Path, ref: Path):
    twin_tree, ref_tree = _parse(twin), _parse(ref)
    ref_module = _module_name(ref)
    twin_defs, twin_imports = _public(twin_tree), _imports(twin_tree)
    problems = []
    for name, node in _public(ref_tree).items():
        if name in twin_defs:
            twin_node = twin_defs[name]
            if isinstance(node, ast.FunctionDef):
                if not isinstance(twin_node, ast.FunctionDef):
                    problems.append(f"{name}: a function in the reference, not in the twin")
                    continue
                if _signature(twin_node) != _signature(node):
                    problems.append(f"{name}: parameters {_signature(twin_node)} != reference "
                                    f"{_signature(node)}")
        elif twin_imports.get(name) != ref_module:
            problems.append(f"{name}: neither defined in the twin nor imported from {ref_module}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("twin, ref", PAIRS, ids=[_module_name(t) for t, _ in PAIRS])
def test_twin_docstrings_start_with_twin_of(twin: Path, ref: Path):
    ref_module = _module_name(ref)
    tree = _parse(twin)
    ref_names = _public(_parse(ref))
    module_doc = ast.get_docstring(tree) or ""
    # a cross-reference in mkdocstrings' syntax: the API page links the twin to its original
    assert module_doc.startswith(f"Twin of [`{ref_module}`][{ref_module}]"), module_doc[:80]
    for name, node in _public(tree).items():
        if isinstance(node, ast.FunctionDef) and name in ref_names:
            doc = " ".join((ast.get_docstring(node) or "").split())  # a long link may wrap
            expected = f"Twin of [`{ref_module}.{name}`][{ref_module}.{name}]."
            assert doc.startswith(expected), f"{name}: docstring starts {doc[:60]!r}"


def test_the_surface_test_can_fail():
    """A renamed parameter or a changed default is caught (the comparison is not vacuous)."""
    ref = ast.parse("def f(x, eps=1e-5):\n    pass\n").body[0]
    renamed = ast.parse("def f(x, epsilon=1e-5):\n    pass\n").body[0]
    redefault = ast.parse("def f(x, eps=1e-6):\n    pass\n").body[0]
    assert _signature(ref) != _signature(renamed)
    assert _signature(ref) != _signature(redefault)
