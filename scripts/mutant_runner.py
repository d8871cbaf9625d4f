r"""A pytest plugin that runs many mutmut mutants in one pytest session (docs/mutation.md).

mutmut 3 starts its tests for each mutant through its own runner; for a module reached by
hundreds of tests (the KV cells, the cache) that runs about two mutants a minute on two cores.
This plugin collects the tests once, in the ``mutants/`` tree mutmut generated, and then for
each mutant forks a child that sets ``MUTANT_UNDER_TEST`` (mutmut's trampolines read it on
every call) and runs the tests until one fails:

- the tests run fastest first (their durations on the unmutated code, measured once and kept
  in ``DURATIONS``), limited to the fastest ``BUDGET`` seconds of them (a *fast subset*: a
  mutant that survives it is then run against the whole selection on its own);
- a test that kills a mutant moves to the front (the mutants of one function are usually
  killed by the same test), and ``FIRST`` may name killers of an earlier run to start with;
- a child that runs past ``LIMIT`` seconds is killed and reported ``timeout`` (rerun it alone);
- ``JOBS`` children at once.

Usage, inside the ``mutants/`` tree (``MUTANTS_FILE``: one mutant name per line; each result is
appended to ``RESULTS_FILE`` as ``name killed|survived|timeout seconds killer``)::

    cd mutants
    MUTANTS_FILE=todo.txt RESULTS_FILE=out.res DURATIONS=dur.json BUDGET=12 LIMIT=45 JOBS=2 \
    HYPOTHESIS_PROFILE=mutation PYTHONPATH=../scripts \
    python -m pytest -q -p mutant_runner -p no:randomly -p no:cacheprovider \
        -k "not mlx and not interface_signatures" tests/laws/test_kv_cells.py ...
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from _pytest.runner import runtestprotocol


def _run_items(items: list) -> str | None:
    """The node id of the first failing test, or None."""
    for it in items:
        reports = runtestprotocol(it, nextitem=None, log=False)
        if any(r.failed for r in reports):
            return it.nodeid
    return None


def _ordered(session, out) -> list:
    """The tests fastest first, within the budget, earlier killers first."""
    path = os.environ["DURATIONS"]
    dur = json.load(open(path)) if os.path.exists(path) else {}
    for it in session.items:
        if it.nodeid not in dur:
            t = time.time()
            reports = runtestprotocol(it, nextitem=None, log=False)
            dur[it.nodeid] = time.time() - t
            if any(r.failed for r in reports):
                out.write(f"ORIGINAL-FAILS {it.nodeid}\n")
    json.dump(dur, open(path, "w"))
    items = sorted(session.items, key=lambda it: dur[it.nodeid])
    budget, acc, keep = float(os.environ.get("BUDGET", "1e9")), 0.0, []
    for it in items:
        acc += dur[it.nodeid]
        if acc > budget:
            break
        keep.append(it)
    if os.environ.get("FIRST"):
        rank = {n.strip(): i for i, n in enumerate(open(os.environ["FIRST"])) if n.strip()}
        keep.sort(key=lambda it: rank.get(it.nodeid, len(rank)))
    out.write(f"# {len(keep)} tests, {sum(dur[it.nodeid] for it in keep):.1f} s\n")
    return keep


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session) -> bool:
    names = [line.split()[0] for line in open(os.environ["MUTANTS_FILE"]) if line.strip()]
    jobs = int(os.environ.get("JOBS", "2"))
    out = open(os.environ["RESULTS_FILE"], "a", buffering=1)
    os.environ["MUTANT_UNDER_TEST"] = ""
    items = _ordered(session, out)
    limit = float(os.environ.get("LIMIT", "60"))
    running: dict[int, tuple[str, float, int]] = {}  # pid -> (mutant, start, pipe)

    def finished(pid: int, name: str, t0: float, rfd: int, status: int | None) -> None:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            result, killer = "timeout", "-"
        else:
            killer = os.read(rfd, 4096).decode() or "-"
            code = os.waitstatus_to_exitcode(status)
            result = {0: "survived", 1: "killed"}.get(code, f"rc{code}")
            for i, it in enumerate(items):  # move to front
                if it.nodeid == killer:
                    items.insert(0, items.pop(i))
                    break
        os.close(rfd)
        out.write(f"{name} {result} {time.time() - t0:.1f}s {killer}\n")

    while names or running:
        while names and len(running) < jobs:
            name = names.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: one mutant
                os.close(r)
                os.environ["MUTANT_UNDER_TEST"] = name
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                try:
                    killer = _run_items(items)
                except BaseException as e:  # noqa: BLE001 - any escape is a kill
                    killer = f"EXC:{type(e).__name__}"
                os.write(w, (killer or "").encode())
                os._exit(1 if killer else 0)
            os.close(w)
            running[pid] = (name, time.time(), r)
        time.sleep(0.05)
        for pid, (name, t0, rfd) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done or time.time() - t0 > limit:
                del running[pid]
                finished(pid, name, t0, rfd, status if done else None)
    return True
