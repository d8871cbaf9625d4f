"""Shared test configuration: hypothesis profiles, the oracle rule, the shared fixtures.

- ``HYPOTHESIS_PROFILE=ci`` (set by ``.ci/run``) keeps property tests small and deterministic
  enough for a CI run of a few minutes, except for the stateful machines and the state laws
  (save/restore, states crossing between the twins), which take ``ci-deep``: more examples
  and steps, still derandomized (:func:`tests.support.helpers.deep`). ``dev`` is the default;
  ``thorough`` digs deeper. ``mutation`` is ``ci`` without the shrink phase (and
  ``mutation-deep`` is ``ci-deep`` without it), for mutation runs (``docs/mutation.md``): a
  mutant is killed by the first failing example, and shrinking it only spends the run's time
  limit.
- Tests marked ``oracle`` compare against an external implementation. When
  ``LLAMAREF_REQUIRE_ORACLES=1`` (set by ``.ci/run``) every skipped test is reported as a
  failure, oracles above all (an oracle that did not run proved nothing); the one exception
  is a test that needs ``../shared/fixtures`` on a machine that does not have it.
- ``shared_fixtures`` is ``../shared/fixtures`` when that folder exists; tests that need it
  skip cleanly when it does not (it is not part of the repository).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

# One BLAS thread per test process: `pytest -n 2` on 2 cores otherwise over-subscribes the CPU
# (a SmolLM2 decode goes from ~0.17 s to ~0.95 s). Set before NumPy loads OpenBLAS
# (pytest and hypothesis do not import NumPy).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# MLX's CPU backend JIT-compiles fused kernels with g++ into $TMPDIR/mlx/<version>/cpu and
# checks only that the .so exists before dlopen-ing it: two xdist workers compiling the same
# kernel race (one loads the other's half-written library and crashes). Give each worker its
# own TMPDIR, read by the C++ side at every compile.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    _tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"llamaref-mlx-{_WORKER}"
    _tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(_tmp)


settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The stateful machines and the state laws dig deeper in CI (tests.support.helpers.deep):
# memory bugs hide in long sequences of operations.
settings.register_profile(
    "ci-deep",
    parent=settings.get_profile("ci"),
    max_examples=100,
    stateful_step_count=50,
)
_NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]
settings.register_profile("mutation", parent=settings.get_profile("ci"), phases=_NO_SHRINK)
settings.register_profile(
    "mutation-deep", parent=settings.get_profile("ci-deep"), phases=_NO_SHRINK
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

REPO = Path(__file__).resolve().parent.parent
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"


@pytest.fixture(scope="session")
def shared_fixtures() -> Path:
    """The conformance data in ``../shared/fixtures``; skips the test when it is absent."""
    if not SHARED_FIXTURES.is_dir():
        pytest.skip("../shared/fixtures is not present on this machine")
    return SHARED_FIXTURES


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``LLAMAREF_REQUIRE_ORACLES=1``, a skip is a failure (but for ``../shared``)."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("LLAMAREF_REQUIRE_ORACLES") != "1" or not report.skipped:
        return
    if "shared_fixtures" in getattr(item, "fixturenames", ()) and not SHARED_FIXTURES.is_dir():
        return  # the conformance data is not part of the repository
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    kind = "oracle test" if item.get_closest_marker("oracle") is not None else "test"
    report.outcome = "failed"
    report.longrepr = f"{kind} skipped, but LLAMAREF_REQUIRE_ORACLES=1: {reason}"
