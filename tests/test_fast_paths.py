"""The rule and its fast path, held by the source.

The reference is the specification first; where it must also be fast (it is the Linux runtime
and the twin's host bookkeeping), the readable rule keeps the plain name and the faster form
sits beside it, named as such. Two rules, for every module of ``reference/`` and
``accelerated/``:

1. **A fast path names its rule and its property test.** A function or method whose name ends
   in ``_fast``, or whose docstring opens "Fast path of", has a docstring that opens
   ``Fast path of [`rule`][target].`` (an mkdocstrings cross-reference: ``target`` a dotted
   name, or empty for a name of the same module or class) naming a rule that exists (for
   ``<rule>_fast``, the rule is ``<rule>``), and names the property test that holds the two
   equal as ``tests/<folder>/<file>.py::<test_name>``, a test function that exists.
2. **No timing in a docstring or a comment.** Measurements go out of date and belong in
   ``docs/performance.md`` with their method and date; the source says what a fast path
   saves in words ("no pass over the cells"), not in microseconds. A number followed by a
   time unit (``15 µs``, ``21 ms``, ``2 s``, ``3 seconds``), a speed-up (``1.7 times
   faster``, ``35% faster``) or a throughput (``200 t/s``) is refused; a unit that names
   a field (``t_eval_ms``, "microseconds since the loop started") and a doctest's output
   are not timings.

Everything here reads the source with :mod:`ast` and :mod:`tokenize`; nothing is imported.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "accelerated")

#: the opening of a fast path's docstring: the rule as a cross-reference
RULE_LINK = re.compile(r"^Fast path of \[`(?P<name>[\w.]+)`\]\[(?P<target>[\w.]*)\]")
#: a test named in a docstring: ``tests/laws/test_kq_mask.py::test_name``
TEST_REF = re.compile(r"(?P<path>tests/[\w/]+\.py)::(?P<name>\w+(?:::\w+)*)")

_NUMBER = r"(?<![\w.])(?:\d+(?:\.\d+)?|two|three|four|five|ten|a hundred)"
#: a quoted measurement: a number and a time unit, a speed-up, a share of a time, a throughput
TIMING = re.compile(
    rf"{_NUMBER}\s*(?:µs|us|ms|ns)\b"
    rf"|{_NUMBER}[ \n]s\b(?!')"
    rf"|{_NUMBER}\s+(?:(?:micro|milli|nano)?seconds?|minutes?|hours?)\b"
    rf"|{_NUMBER}\s*(?:×|x|times|%)\s+(?:faster|slower|quicker)\b"
    rf"|\btwice\s+as\s+(?:fast|slow)\b"
    rf"|{_NUMBER}\s+of\s+the\s+time\b"
    rf"|{_NUMBER}\s*(?:t/s|tok/s|tokens\s+per\s+second)"
)


# ---------------------------------------------------------------------------------------------
# Reading the source
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Function:
    """One function or method of a module, with the classes around it."""

    path: str  # "reference/memory/kq_mask.py", for messages
    line: int
    classes: tuple[ast.ClassDef, ...]  # outermost first
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def qualname(self) -> str:
        return ".".join([*(c.name for c in self.classes), self.node.name])

    @property
    def doc(self) -> str:
        """The docstring on one line (a long cross-reference may wrap)."""
        return " ".join((ast.get_docstring(self.node) or "").split())

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line} {self.qualname}"


def functions(tree: ast.AST, path: str, classes: tuple = ()) -> Iterator[Function]:
    """Every function and method, nested classes included (not functions inside functions)."""
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield Function(path, node.lineno, classes, node)
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, path, (*classes, node))


def bound_names(scope: ast.AST) -> dict[str, ast.AST]:
    """The names a module or class body binds: defs, classes, assignments, imports."""
    out: dict[str, ast.AST] = {}
    for node in getattr(scope, "body", []):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return out


def lookup(scope: ast.AST, dotted: list[str]) -> bool:
    """Whether ``scope`` binds ``dotted[0]``, whose body binds ``dotted[1]``, and so on."""
    for name in dotted:
        scope = bound_names(scope).get(name)
        if scope is None:
            return False
    return True


@functools.cache
def module_tree(module: str) -> ast.Module | None:
    """The syntax tree of one of our modules or test files by dotted name; None if no file."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return None


def target_exists(dotted: str) -> bool:
    """Whether a dotted name (``reference.ops.attention.build_attn_mha``,
    ``reference.memory.kv_cache.KVCache._find_cells``) names something in our source."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        tree = module_tree(".".join(parts[:i]))
        if tree is not None:
            return lookup(tree, parts[i:])
    return False


def defines_test(path: str, name: str) -> bool:
    """Whether ``path`` (relative to the repository) defines the test ``name``
    (``test_x``, or ``TestClass::test_x``)."""
    file = ROOT / path
    if not file.is_file():
        return False
    return lookup(ast.parse(file.read_text(encoding="utf-8")), name.split("::"))


# ---------------------------------------------------------------------------------------------
# Rule 1: a fast path names its rule and its property test
# ---------------------------------------------------------------------------------------------


def is_fast_path(fn: Function) -> bool:
    return fn.node.name.endswith("_fast") or fn.doc.startswith("Fast path of")


def rule_exists(fn: Function, tree: ast.Module, name: str, target: str) -> bool:
    """The rule of ``[`name`][target]``: ``target`` anywhere in our source, or, when it is
    empty, ``name`` in the enclosing classes (innermost first) or the module."""
    if target:
        return target_exists(target)
    scopes = [*reversed(fn.classes), tree]
    return any(lookup(scope, name.split(".")) for scope in scopes)


def fast_path_problems(fn: Function, tree: ast.Module) -> list[str]:
    """What is wrong with one fast path's docstring (nothing when it is not a fast path)."""
    if not is_fast_path(fn):
        return []
    link = RULE_LINK.match(fn.doc)
    if link is None:
        return [f"{fn.where}: a fast path's docstring opens 'Fast path of [`rule`][...].', "
                f"naming its rule as a cross-reference; it opens {fn.doc[:60]!r}"]
    problems = []
    name, target = link["name"], link["target"]
    if not rule_exists(fn, tree, name, target):
        problems.append(f"{fn.where}: its rule [`{name}`][{target}] names nothing in our "
                        "source")
    if fn.node.name.endswith("_fast"):
        rule = fn.node.name.removesuffix("_fast")
        if (target or name).split(".")[-1] != rule:
            problems.append(f"{fn.where}: {fn.node.name} is the fast path of {rule}, but its "
                            f"docstring names [`{name}`][{target}]")
    tests = list(TEST_REF.finditer(fn.doc))
    if not tests:
        problems.append(f"{fn.where}: a fast path names the property test that holds it "
                        "equal to its rule, as tests/<folder>/<file>.py::<test_name>")
    problems += [f"{fn.where}: the test {t[0]} does not exist (moved or renamed?)"
                 for t in tests if not defines_test(t["path"], t["name"])]
    return problems


# ---------------------------------------------------------------------------------------------
# Rule 2: no timing in a docstring or a comment
# ---------------------------------------------------------------------------------------------


def prose(docstring: str) -> str:
    """A docstring less its doctest examples (a ``>>>`` line, its ``...`` continuations and
    its output, up to a blank line), each left as an empty line so that lines keep their
    numbers."""
    lines, in_example = [], False
    for line in docstring.splitlines():
        stripped = line.strip()
        if stripped.startswith(">>>"):
            in_example = True
        elif not stripped:
            in_example = False
        lines.append("" if in_example else line)
    return "\n".join(lines)


def is_string(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
        and isinstance(statement.value.value, str)


def texts(source: str) -> Iterator[tuple[int, str]]:
    """``(first line number, text)`` of every docstring (less its examples) and every comment.

    A docstring is one text, so that a measurement wrapped over two lines is still read."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for i, statement in enumerate(node.body):
            # the docstring, and an attribute's (a string after an assignment, as mkdocstrings
            # reads it)
            after_assignment = i > 0 and isinstance(node.body[i - 1], ast.Assign | ast.AnnAssign)
            if (i == 0 or after_assignment) and is_string(statement):
                yield statement.lineno, prose(statement.value.value)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def timing_problems(source: str, path: str) -> list[str]:
    problems = []
    for first, text in texts(source):
        for match in TIMING.finditer(text):
            number = first + text.count("\n", 0, match.start())
            line = text.splitlines()[number - first].strip()
            problems.append(f"{path}:{number}: quotes a timing ({' '.join(match[0].split())!r} "
                            f"in {line!r}); measurements go to docs/performance.md, with how "
                            "and when they were taken")
    return problems


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


def sources() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]


def report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n" + "\n".join(problems)


def check_fast_paths(source: str, path: str) -> list[str]:
    tree = ast.parse(source)
    return [p for fn in functions(tree, path) for p in fast_path_problems(fn, tree)]


def test_every_fast_path_names_its_rule_and_its_property_test():
    problems = [p for path in sources()
                for p in check_fast_paths(path.read_text(encoding="utf-8"),
                                          str(path.relative_to(ROOT)))]
    assert not problems, report(problems)


def test_there_are_fast_paths():
    """The check is not vacuous: the fast paths the chapters show are found."""
    found = {f"{path.relative_to(ROOT)}::{fn.qualname}"
             for path in sources()
             for fn in functions(ast.parse(path.read_text(encoding="utf-8")), "")
             if is_fast_path(fn)}
    assert {
        "reference/memory/kq_mask.py::set_input_kq_mask_fast",
        "reference/memory/kq_mask.py::visible_prefix",
        "reference/memory/kv_cache.py::KVCache._find_cells_fast",
        "reference/batch.py::fill_fields_one_token",
        "reference/ops/attention.py::attend_visible",
        "reference/ops/matmul.py::_few_rows",
        "reference/models/llama.py::graph_rope",
    } <= found, sorted(found)


def test_no_docstring_or_comment_quotes_a_timing():
    problems = [p for path in sources()
                for p in timing_problems(path.read_text(encoding="utf-8"),
                                         str(path.relative_to(ROOT)))]
    assert not problems, report(problems)


# ---- the checkers on sources made to fail ------------------------------------------------------

GOOD = '''
def rule(x):
    """The rule."""

def rule_fast(x):
    """Fast path of [`rule`][]: the same, sooner.

    Held equal by ``tests/test_fast_paths.py::test_the_checker_accepts_a_good_fast_path``.
    """

class Cache:
    def find(self):
        """The rule."""

    def find_fast(self):
        """Fast path of [`find`][]: ``tests/test_fast_paths.py::test_there_are_fast_paths``."""

def helper():
    """Fast path of [`build_attn_mha`][reference.ops.attention.build_attn_mha] when few cells
    are seen (``tests/test_fast_paths.py::test_there_are_fast_paths``)."""
'''


def test_the_checker_accepts_a_good_fast_path():
    assert check_fast_paths(GOOD, "good.py") == []


@pytest.mark.parametrize("source, problem", [
    ('def rule():\n    "The rule."\n\ndef rule_fast():\n    "The same, sooner."\n',
     "opens 'Fast path of"),
    ('def rule_fast():\n    """Fast path of [`rule`][]: tests/test_fast_paths.py::'
     'test_there_are_fast_paths."""\n', "names nothing"),
    ('def f():\n    """Fast path of [`g`][reference.nowhere.g]: tests/test_fast_paths.py::'
     'test_there_are_fast_paths."""\n', "names nothing"),
    ('def rule():\n    "The rule."\n\ndef rule_fast():\n    """Fast path of [`rule`][]: '
     'held equal by a property test."""\n', "names the property test"),
    ('def rule():\n    "The rule."\n\ndef rule_fast():\n    """Fast path of [`rule`][]: '
     'tests/test_fast_paths.py::test_that_does_not_exist."""\n', "does not exist"),
    ('def rule():\n    "The rule."\n\ndef rule_fast():\n    """Fast path of [`rule`][]: '
     'tests/nowhere/test_x.py::test_y."""\n', "does not exist"),
    ('def rule():\n    "The rule."\n\ndef other():\n    "The rule."\n\ndef rule_fast():\n'
     '    """Fast path of [`other`][]: tests/test_fast_paths.py::test_there_are_fast_paths."""\n',
     "is the fast path of rule"),
])
def test_the_checker_refuses_a_bad_fast_path(source, problem):
    problems = check_fast_paths(source, "bad.py")
    assert problems and all("bad.py" in p for p in problems)
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize("text", [
    "15 µs for one token", "from 42 to 9 us", "21 ms against 18", "about 0.6 ms instead",
    "takes 2 s per ubatch", "3 seconds", "6 minutes to build", "1.7 times faster",
    "25-35% faster", "4x faster", "ten times slower", "twice as fast", "200 t/s",
    "350 tokens per second", "0.3 to 0.7 of the time", "1.7\n    times faster",
])
def test_the_checker_refuses_a_timing(text):
    docstring = f'def f():\n    """Fast.\n\n    {text}.\n    """\n'
    attribute = f'N = 4\n"""The count.\n\n{text}."""\n'
    comment = f"x = 1  # {' '.join(text.split())}\n"
    for source in (docstring, attribute, comment):
        assert timing_problems(source, "bad.py"), source


@pytest.mark.parametrize("text", [
    "microseconds since the loop started", "t_eval_ms: the time of the evaluations",
    "n_ms = 0", "the faster form", "4 sequences", "32 rows of 64", "the 2nd token",
    "a timestamp in ms", "float32", "h2 seq", "at least 50% of the time", "the last 2 tokens",
])
def test_the_checker_accepts_units_without_a_measurement(text):
    docstring = f'def f():\n    """Fast.\n\n    {text}.\n    """\n'
    comment = f"x = 1  # {text}\n"
    assert timing_problems(docstring, "ok.py") == timing_problems(comment, "ok.py") == []


def test_a_doctest_output_is_not_a_timing():
    source = ('def f():\n    """A report.\n\n    Examples:\n        >>> print(f())\n'
              '        eval time = 40.00 ms / 8 tokens\n\n    And 3 ms here.\n    """\n')
    assert [p.split(":")[1] for p in timing_problems(source, "f.py")] == ["8"]
