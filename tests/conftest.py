"""Shared test configuration: hypothesis profiles, the oracle rule, the shared fixtures.

- ``HYPOTHESIS_PROFILE=ci`` (set by ``.ci/run``) keeps property tests small and deterministic
  enough for a CI run of a few minutes; ``dev`` is the default; ``thorough`` digs deeper.
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
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
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
