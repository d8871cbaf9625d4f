"""The three layers, held by their imports.

llamaref is three packages stacked like llama.cpp's ``src/`` under ``tools/``, each importing
only itself and the layers below it:

- ``reference/``: the specification, in NumPy. It imports nothing of ours but itself, and
  its library (everything but ``reference/tools/``) imports none of its programs.
- ``accelerated/``: its MLX twin. It imports ``reference/`` (the bookkeeping, the host-side
  pieces) and itself.
- ``llamaref/``: the application (cli, backends, bench, verify). It imports both.
- ``scripts/``: measurements and chores run from the repository root. They import any of the
  three, and nothing imports them.
- ``tests/`` sits on top, and nothing imports it: the tiny models that docstrings and docs
  pages need live in :mod:`reference.testing`.

Inside the layers, three more rules keep the module graph honest:

- our imports are at the top of a module. An import of ours inside a function hides a
  dependency, most often a cycle (``a`` imports ``b`` at the top, ``b`` imports ``a`` when
  called). The rare heavy optional import is listed in :data:`FUNCTION_LEVEL_ALLOWED`, with
  its reason.
- the modules of a package import each other without cycles.
- the memory (``memory/``) sits below the model graphs (``models/``): a graph reads its
  memory through :mod:`reference.memory.interface`, never the other way.

Everything here reads the source with :mod:`ast`; nothing is imported, so the tests take well
under a second and a module that fails to import cannot hide a violation.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The layers, bottom to top: a module may import its own layer and the layers before it.
#: ``scripts/`` (measurements and chores, run from the repository root) sits on the three that
#: ship: it may import any of them, and none of them imports it.
LAYERS = ("reference", "accelerated", "llamaref", "scripts", "tests")
PACKAGES = LAYERS[:-1]  # the layers read here: the three that ship, and scripts/

#: ``(module, imported module) -> why`` for our imports that stay inside a function.
#: Keep it tiny: each entry is a dependency the module graph does not show.
FUNCTION_LEVEL_ALLOWED: dict[tuple[str, str], str] = {}


# ---------------------------------------------------------------------------------------------
# Reading the imports
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One module of ours named by an import statement in one of our modules."""

    module: str  # the importer: "reference.gguf"
    path: str  # its file: "reference/gguf.py"
    line: int
    target: str  # the module imported: "reference.quants" (``from pkg import sub``: pkg.sub)
    in_function: bool  # inside a def: runs when called, not when the module is imported
    type_checking: bool  # under ``if TYPE_CHECKING:``: never runs

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def at_import_time(self) -> bool:
        """The import runs when the module is imported: an edge of the module graph."""
        return not self.in_function and not self.type_checking


def layer(module: str) -> str:
    return module.split(".")[0]


def inside(module: str, package: str) -> bool:
    """``module`` is ``package`` or one of its submodules."""
    return module == package or module.startswith(package + ".")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def sources() -> dict[str, Path]:
    """Module name -> file, for every module of the shipped layers."""
    files = (p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py")))
    return {module_name(p): p for p in files}


@functools.cache
def syntax_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list:
    """The modules an import statement names; ``from pkg import name`` names ``pkg.name``
    when that is a module of ours, else ``pkg``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: ``from . import x``, ``from ..ops import y``
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    submodules = (f"{base}.{alias.name}" for alias in node.names)
    return list(dict.fromkeys(name if name in sources() else base for name in submodules))


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    """Every import statement of one module, with where it sits (function, TYPE_CHECKING)."""

    def __init__(self, module: str, path: Path):
        self.module, self.path = module, path
        self.is_package = path.name == "__init__.py"
        self.functions = 0
        self.type_checking = False
        self.found: list[Import] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if not is_type_checking(node.test):
            self.generic_visit(node)
            return
        outer, self.type_checking = self.type_checking, True
        for statement in node.body:
            self.visit(statement)
        self.type_checking = outer
        for statement in node.orelse:
            self.visit(statement)

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for target in imported_modules(node, self.module, self.is_package):
            if layer(target) in LAYERS:
                where = str(self.path.relative_to(ROOT))
                self.found.append(Import(self.module, where, node.lineno, target,
                                         self.functions > 0, self.type_checking))

    visit_ImportFrom = visit_Import


@functools.cache
def our_imports() -> tuple[Import, ...]:
    """Every import of one of our modules, in every module of the shipped layers."""
    found: list[Import] = []
    for module, path in sources().items():
        collector = _ImportCollector(module, path)
        collector.visit(syntax_tree(path))
        found += collector.found
    return tuple(found)


def report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n" + "\n".join(violations)


# ---------------------------------------------------------------------------------------------
# The layers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("package", PACKAGES)
def test_a_layer_imports_only_itself_and_the_layers_below(package):
    """``reference`` imports no ``accelerated``, ``llamaref`` or ``tests``; ``accelerated``
    no ``llamaref`` or ``tests``; ``llamaref`` no ``tests``. Anywhere: at the top, inside a
    function or under ``TYPE_CHECKING``."""
    allowed = LAYERS[: LAYERS.index(package) + 1]
    violations = [
        f"{i.where}: {i.module} imports {i.target}, but {package}/ may import only "
        f"{', '.join(allowed)}. Move what it needs down into {package}/ or below (the tiny "
        "models of the tests are reference.testing), or move this code up to the layer that "
        "uses it."
        for i in our_imports()
        if layer(i.module) == package and layer(i.target) not in allowed
    ]
    assert not violations, report(violations)


def test_our_imports_are_at_the_top_of_the_module():
    """An import of ours inside a function hides a dependency (most often a cycle) from a
    reader and from :func:`test_a_package_has_no_import_cycles`."""
    violations = [
        f"{i.where}: {i.module} imports {i.target} inside a function. Import it at the top of "
        "the module; if that makes a cycle, move the names both modules need into the lower "
        "one. Only for a heavy optional import, add "
        f"({i.module!r}, {i.target!r}) to FUNCTION_LEVEL_ALLOWED in {Path(__file__).name}, "
        "with the reason."
        for i in our_imports()
        if i.in_function and (i.module, i.target) not in FUNCTION_LEVEL_ALLOWED
    ]
    assert not violations, report(violations)


def test_every_allowed_function_level_import_is_still_there():
    """An entry of the allow-list that no longer matches an import is removed."""
    found = {(i.module, i.target) for i in our_imports() if i.in_function}
    violations = [
        f"{Path(__file__).name}: FUNCTION_LEVEL_ALLOWED[({module!r}, {target!r})] matches no "
        "import inside a function any more: remove the entry."
        for module, target in FUNCTION_LEVEL_ALLOWED
        if (module, target) not in found
    ]
    assert not violations, report(violations)


# ---------------------------------------------------------------------------------------------
# Examples: docstrings and docs pages use reference.testing, never tests/
# ---------------------------------------------------------------------------------------------

# ``from tests...`` / ``import tests`` at the start of a line, after an optional ``>>>`` or
# ``...`` prompt.
IMPORTS_TESTS = re.compile(r"^\s*(?:(?:>>>|\.\.\.)\s+)?(?:from\s+tests[.\s]|import\s+tests\b)")
DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstring_lines(tree: ast.Module):
    """``(line number, line)`` of every docstring in a module."""
    for node in ast.walk(tree):
        if not isinstance(node, DOCSTRING_OWNERS) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
            first.value.value, str
        ):
            for offset, line in enumerate(first.value.value.splitlines()):
                yield first.lineno + offset, line


def python_block_lines(text: str):
    """``(line number, line)`` of every line inside a fenced Python block of a Markdown page
    (```` ```python ```` or ```` ```{.python .notest} ````)."""
    fence = None  # the opening fence's indentation, inside a Python block
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.lstrip()
        if fence is None and stripped.startswith("```") and "python" in stripped:
            fence = line[: len(line) - len(stripped)]
        elif fence is not None and stripped.startswith("```"):
            fence = None
        elif fence is not None:
            yield number, line


def test_no_docstring_imports_tests():
    violations = [
        f"{path.relative_to(ROOT)}:{number}: a docstring example imports tests/ "
        f"({line.strip()!r}); the shipped layers cannot see it. Import from reference.testing "
        "(move the helper there if it is missing)."
        for path in sources().values()
        for number, line in docstring_lines(syntax_tree(path))
        if IMPORTS_TESTS.match(line)
    ]
    assert not violations, report(violations)


def test_no_docs_page_imports_tests():
    violations = [
        f"{page.relative_to(ROOT)}:{number}: a Python block imports tests/ "
        f"({line.strip()!r}); a reader does not have it. Import from reference.testing "
        "(move the helper there if it is missing)."
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for number, line in python_block_lines(page.read_text(encoding="utf-8"))
        if IMPORTS_TESTS.match(line)
    ]
    assert not violations, report(violations)


# ---------------------------------------------------------------------------------------------
# The module graph
# ---------------------------------------------------------------------------------------------


def import_cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per back edge of a depth-first search over ``edges``."""
    visiting: list[str] = []  # the path from the root of the search
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        visiting.append(module)
        for target in sorted(edges.get(module, {})):
            if target in visiting:
                cycles.append([*visiting[visiting.index(target):], target])
            elif target not in done:
                visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(edges):
        if module not in done:
            visit(module)
    return cycles


def pairs(cycle: list[str]) -> list[tuple[str, str]]:
    """The edges of a cycle ``[a, b, c, a]``: ``(a, b), (b, c), (c, a)``."""
    return list(zip(cycle[:-1], cycle[1:], strict=True))


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_has_no_import_cycles(package):
    """The imports that run when a module is imported (at the top, not under
    ``TYPE_CHECKING``) go one way between the modules of a package."""
    edges: dict[str, dict[str, Import]] = {}
    for i in our_imports():
        if i.at_import_time and layer(i.module) == package and layer(i.target) == package:
            edges.setdefault(i.module, {}).setdefault(i.target, i)
    violations = [
        "import cycle "
        + " -> ".join([cycle[0], *(f"{b} ({edges[a][b].where})" for a, b in pairs(cycle))])
        + ". Modules that import each other are one concept split in the wrong place: move "
        "the names both need into the lower module (or a new one both import)."
        for cycle in import_cycles(edges)
    ]
    assert not violations, report(violations)


@pytest.mark.parametrize("twin", ["reference", "accelerated"])
def test_the_memory_imports_no_model_graph(twin):
    """``memory/`` sits below ``models/``: the graphs read the memory through
    :mod:`reference.memory.interface`; the memory knows only the hyperparameters."""
    violations = [
        f"{i.where}: {i.module} imports {i.target}, but the memory sits below the model "
        "graphs. Move what it needs into reference/hparams.py or reference/memory/."
        for i in our_imports()
        if inside(i.module, f"{twin}.memory")
        and (inside(i.target, "reference.models") or inside(i.target, "accelerated.models"))
    ]
    assert not violations, report(violations)


def test_the_library_imports_no_program():
    """``reference/tools/`` (llama.cpp's ``tools/`` and ``examples/``: generation, batched,
    speculative, perplexity, the server's scheduler...) sits on top of the library (its
    ``src/``): a program imports the library, never the other way. Anywhere: at the top,
    inside a function or under ``TYPE_CHECKING``."""
    violations = [
        f"{i.where}: {i.module} imports {i.target}, but the library part of reference/ never "
        "imports a program. Move what both need down into the library (or the code that "
        "needs the program up into reference/tools/)."
        for i in our_imports()
        if inside(i.module, "reference")
        and not inside(i.module, "reference.tools")
        and inside(i.target, "reference.tools")
    ]
    assert not violations, report(violations)


def test_the_server_scheduler_owns_no_runtime():
    """The server's specification (``reference/tools/server/``) decides which slot runs what
    and which tokens a step decodes; the thread, the queue and the locks that drive it are the
    application's (``llamaref/server/``), as llama.cpp's ``server_queue`` drives
    ``server_context::update_slots``."""
    runtime = ("threading", "queue", "asyncio", "concurrent", "socket", "http")
    violations = [
        f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}, a runtime module; the "
        "scheduler is a pure step. Move the thread/queue/HTTP code to llamaref/server/."
        for module, path in sources().items()
        if inside(module, "reference.tools.server")
        for node in ast.walk(syntax_tree(path))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
        if name.split(".")[0] in runtime
    ]
    assert not violations, report(violations)


# ---------------------------------------------------------------------------------------------
# Private names stay in their module
# ---------------------------------------------------------------------------------------------


def private_imports(tree: ast.Module) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every ``from <one of ours> import _name`` in a module (a
    ``__dunder__`` is not private)."""
    return [
        (node.lineno, node.module or ".", alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.level or layer(node.module or "") in LAYERS)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.endswith("__")
    ]


def test_no_private_imports_across_modules():
    """A name with a leading underscore is its module's own business: another module of
    ``reference/`` or ``accelerated/`` that needs it (a validator the twin shares, a helper
    two modules use) gets it public, with a docstring that states its contract."""
    assert private_imports(ast.parse("from reference.ops.rows import _check, get_rows\n"
                                     "from llamaref import __version__\n")) == [
        (1, "reference.ops.rows", "_check")]  # the check can fail
    violations = [
        f"{path.relative_to(ROOT)}:{line}: imports {name} from {source}, a private name of "
        "another module. Make it public there (drop the underscore, give it a docstring "
        "contract) or move the code that needs it into that module."
        for module, path in sources().items()
        if layer(module) in ("reference", "accelerated")
        for line, source, name in private_imports(syntax_tree(path))
    ]
    assert not violations, report(violations)
