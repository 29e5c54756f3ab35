"""Fixtures of the integration tests: a :class:`~integration.cluster.Harness` per test, whose
processes are all killed when the test ends (pass or fail) and whose logs' tails join a
failing test's report."""

from __future__ import annotations

import atexit
import re
import signal
import threading
from collections.abc import Generator, Iterator

import pytest

import cairn

from .cluster import Harness, bin_dir, close_all


def pytest_configure(config: pytest.Config) -> None:
    """Kills the tests' processes (each in a process group of its own, so a terminal's
    signals do not reach them) however pytest ends: at exit, and on SIGTERM (a CI
    timeout), which does not run fixtures' teardown."""
    atexit.register(close_all)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, close_all)


def pytest_report_header() -> list[str]:
    """Which package and which binaries the tests run."""
    return [f"cairn {cairn.__version__} from {cairn.__file__}; binaries from {bin_dir()}"]


@pytest.fixture
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """The harness of this test (fails, never skips, if the binaries are not built)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    h = Harness(name)
    try:
        yield h
    finally:
        h.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Adds the tails of the processes' logs to a failing test's report (the logs stay in
    ``target/python-it-logs/<test>/``)."""
    report = yield
    if not report.failed:
        return report
    funcargs = getattr(item, "funcargs", {})
    harness = funcargs.get("harness")
    if isinstance(harness, Harness):
        report.sections.append(
            (
                f"cairn logs ({report.when}; whole logs in {harness.logs})",
                harness.tails(lines=80),
            )
        )
    return report
