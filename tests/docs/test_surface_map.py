"""The map of names (``reference/surface.py``) against the code, the chapters and the page.

- every name in ``ours`` resolves (import the module, then getattr), and a function or class is
  named where it is defined, so that the map's link finds its API entry;
- every chapter is a page under ``docs/`` and its anchor, if any, is one of its headings;
- ``docs/assets/map/table.md`` is what ``docs/figures/map.py`` writes now;
- the public surface is mapped: every public member of ``Context``, every memory operation of
  each memory class, every sampler and every method of the chain, every op that
  ``reference.ops`` exports is a row of the map or in ``NOT_IN_LLAMA_CPP`` with its reason. A
  public method or op added without a row fails here.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import reference.ops
import reference.sampling
from reference.context import Context
from reference.memory.kv_cache import KVCache
from reference.memory.kv_cache_iswa import KVCacheISWA
from reference.memory.recurrent import RecurrentMemory
from reference.surface import (
    COMMON,
    GGML_H,
    GGML_OP,
    INTERNAL,
    KINDS,
    LLAMA_H,
    NOT_IN_LLAMA_CPP,
    SAMPLER,
    SURFACE,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MEMORY_CLASSES = (KVCache, KVCacheISWA, RecurrentMemory)


def load_generator():
    """``docs/figures/map.py`` as a module (``docs/figures`` is not a package)."""
    spec = importlib.util.spec_from_file_location("docs_figures_map",
                                                  DOCS / "figures" / "map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAP = load_generator()


def resolve(dotted: str) -> tuple[str, object]:
    """``(module, raw object)``: the longest importable prefix, then ``getattr_static`` (a
    property stays a property, a staticmethod a staticmethod)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = inspect.getattr_static(obj, attr)
        return module, obj
    raise ImportError(dotted)


def mapped(ours: str) -> bool:
    return any(e.ours == ours for e in SURFACE)


def public(cls: type) -> list[str]:
    """The public members a class defines itself (methods, properties, class attributes)."""
    return [n for n in vars(cls) if not n.startswith("_")]


# ---- the table itself -----------------------------------------------------------------------


@pytest.mark.parametrize("entry", SURFACE, ids=lambda e: f"{e.llama}->{e.ours}")
def test_ours_resolves_where_defined(entry):
    module, obj = resolve(entry.ours)
    if inspect.isfunction(obj) or inspect.isclass(obj):
        assert f"{obj.__module__}.{obj.__qualname__}" == entry.ours, (
            f"{entry.ours} is defined as {obj.__module__}.{obj.__qualname__}: name it there, "
            f"where its API entry is")


@pytest.mark.parametrize("entry", SURFACE, ids=lambda e: f"{e.llama}->{e.chapter}")
def test_chapter_and_section_exist(entry):
    page, _, anchor = entry.chapter.partition("#")
    assert (DOCS / page).is_file(), f"{entry.llama}: no page docs/{page}"
    if anchor:
        assert anchor in MAP.headings(page), (
            f"{entry.llama}: docs/{page} has no heading #{anchor}; its anchors are "
            f"{sorted(MAP.headings(page))}")


def test_rows_are_well_formed():
    """Known kinds, names of their kind, no duplicate row, one line per note."""
    prefix = {LLAMA_H: ("llama_", "LLAMA_"), SAMPLER: ("llama_sampler_",), GGML_OP: ("ggml_",),
              GGML_H: ("ggml_", "gguf_")}
    seen = set()
    for e in SURFACE:
        assert e.kind in KINDS, e
        if e.kind in prefix:
            assert e.llama.startswith(prefix[e.kind]), e
        if e.kind == INTERNAL:
            assert re.fullmatch(r"(llama|llm)_\w+(::\w+)?", e.llama), e
        if e.kind == COMMON:
            assert e.llama.startswith("common_") or " " in e.llama, e
        assert "\n" not in e.note and "|" not in e.note, e
        assert (e.llama, e.ours) not in seen, f"duplicate row {e.llama} -> {e.ours}"
        seen.add((e.llama, e.ours))


def test_not_in_llama_cpp_resolves_with_a_reason():
    for ours, why in NOT_IN_LLAMA_CPP.items():
        resolve(ours)
        assert why.strip(), ours
        assert not mapped(ours), f"{ours} is both mapped and listed as not in llama.cpp"


def test_fragment_is_current():
    committed = MAP.OUT.read_text() if MAP.OUT.exists() else ""
    assert committed == MAP.render(), (
        "docs/assets/map/table.md is stale: run python docs/figures/map.py and commit it")


# ---- the public surface is mapped --------------------------------------------------------------


def unmapped(names: list[str]) -> list[str]:
    return [n for n in names if not mapped(n) and n not in NOT_IN_LLAMA_CPP]


def test_every_public_member_of_context_is_mapped():
    names = [f"reference.context.Context.{n}" for n in public(Context)]
    assert unmapped(names) == [], (
        "public members of Context with no row in reference/surface.py (add one, or a reason "
        "to NOT_IN_LLAMA_CPP)")


def test_every_memory_operation_is_mapped_for_every_memory():
    """llama.h's memory API is ``llama_memory_<op>(mem, ...)``, our ``mem.<op>(...)``: each op of
    the map exists on every memory class and is mapped there under the same llama.h name; a
    public ``seq_*`` method of a memory is mapped."""
    ops = {}
    for e in SURFACE:
        if e.kind == LLAMA_H and re.fullmatch(r"llama_memory_[a-z_]+", e.llama) and (
                e.llama != "llama_memory_t"):
            op = e.llama.removeprefix("llama_memory_")
            assert e.ours.endswith(f".{op}"), f"{e.llama} mapped to {e.ours}, not to .{op}"
            ops[op] = e.llama
    assert {"clear", "seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div"} <= set(ops)
    for cls in MEMORY_CLASSES:
        path = f"{cls.__module__}.{cls.__qualname__}"
        for op, llama in ops.items():
            assert any(e.llama == llama and e.ours == f"{path}.{op}" for e in SURFACE), (
                f"{llama}: no row for {path}.{op}")
        seq_ops = [f"{path}.{n}" for n in public(cls) if n.startswith("seq_")]
        assert unmapped(seq_ops) == [], f"seq_* methods of {path} with no row"


def test_every_sampler_and_chain_method_is_mapped():
    """A sampler is a public function of ``reference.sampling`` that edits the candidates array
    (its first parameter is ``cur``)."""
    samplers = [
        f"reference.sampling.{name}"
        for name, f in vars(reference.sampling).items()
        if inspect.isfunction(f) and not name.startswith("_")
        and f.__module__ == "reference.sampling"
        and next(iter(inspect.signature(f).parameters), None) == "cur"
    ]
    assert len(samplers) >= 15
    chain = [f"reference.sampling.SamplerChain.{n}"
             for n in public(reference.sampling.SamplerChain)]
    assert unmapped(samplers + chain) == [], "samplers with no row in reference/surface.py"


def test_every_op_exported_by_reference_ops_is_mapped():
    """Compared by object, as ``reference.ops`` re-exports what its modules define."""
    objects = {id(resolve(e.ours)[1]) for e in SURFACE}
    objects |= {id(resolve(n)[1]) for n in NOT_IN_LLAMA_CPP}
    ops = {n: getattr(reference.ops, n) for n in reference.ops.__all__}
    missing = [n for n, op in ops.items() if callable(op) and id(op) not in objects]
    assert missing == [], "ops exported by reference.ops with no row in reference/surface.py"


def test_every_ggml_op_row_is_an_op_of_reference_ops():
    """The ggml op group lists exactly the public ops (not a helper, not a private function)."""
    exported = {id(getattr(reference.ops, n)) for n in reference.ops.__all__}
    for e in SURFACE:
        if e.kind == GGML_OP:
            assert id(resolve(e.ours)[1]) in exported, f"{e.ours} is not exported by reference.ops"
