"""The suite's time budget (docs/testing.md "Keeping the budget"): a closing line per tier and the unit tier's guard.

Loaded by tests/conftest.py:

* **Per-tier lines.** At the end of every run pytest prints, just above its own closing line, one line per tier
  (unit, integration, cluster) with the tests it ran, their outcomes and the tier's wall time (from the start of its
  first test to the end of its last, in seconds; tiers overlap when tests run side by side), and a total line
  with the session's wall time. Under pytest-xdist the controller prints them from the workers' reports.
* **The unit tier's guard.** A unit test whose own time (its call plus the setup of its function-scoped fixtures;
  session- and module-scoped fixtures, built once for many tests, are not counted) is over ``UNIT_TEST_LIMIT_S``
  (5 s) of CPU time (this process and the subprocesses it waited for), or over ``WALL_FACTOR`` times that of wall
  time (a test that waits), fails with a message naming the limit and the way out. CPU time, because wall time
  on a 2-core machine doubles whenever the other worker trains: the same test must not pass alone and fail
  beside a training run. The unit tier's summed test time over
  ``UNIT_TIER_BUDGET_S`` fails the run (exit status 1) with the slowest unit tests named. Both limits hold on the
  slowest machine kind CI gets (AMD EPYC without AVX-512, 2 cores) with room for the other worker's load; a slower
  run (coverage, a debugger) raises them with ``SFT_UNIT_TEST_LIMIT_S`` / ``SFT_UNIT_TIER_BUDGET_S`` (seconds; 0 turns
  the check off).
* Side by side: scripts/test.sh runs two pytest-xdist workers with ``--dist loadfile``: every test file runs whole
  in one worker, so a module-scoped fixture is built once, and the one SLURM cluster (tests/cluster/conftest.py,
  used by tests/cluster/test_slurm.py alone) is started once. (``--dist loadgroup`` with ``xdist_group`` marks does
  not group under pytest 9: xdist 3.8 writes the group into ``item._nodeid``, which pytest 9 no longer reads.)
"""
from __future__ import annotations

import os
import resource
import time

import pytest

TIERS = ("unit", "integration", "cluster")
UNIT_TEST_LIMIT_S = 5.0
WALL_FACTOR = 3  # wall time may reach 3x the limit (the other worker's load; a test that waits): 15 s
UNIT_TIER_BUDGET_S = 180.0
# session fixtures that cost nothing to build again in another worker (files cached on disk, a tokenizer load)


def _limit(env: str, default: float) -> float:
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{env}={raw!r}: must be a number of seconds (0 turns the check off)") from None
    if value < 0:
        raise pytest.UsageError(f"{env}={raw!r}: must be >= 0 (0 turns the check off)")
    return value


def tier_of_nodeid(nodeid: str) -> str | None:
    """``tests/unit/test_x.py::test_y`` -> ``unit``; None outside the tier folders."""
    parts = nodeid.split("::", 1)[0].replace("\\", "/").split("/")
    if len(parts) >= 3 and parts[0] == "tests" and parts[1] in TIERS:
        return parts[1]
    return None


def _fmt(seconds: float) -> str:
    """``754.2`` -> ``754 s (12 min 34 s)``; under a minute just the seconds."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{seconds:.0f} s ({m} min {s:02d} s)" if m else f"{seconds:.0f} s"


# --------------------------------------------------------------------------------------------- the unit guard

def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended (a subprocess.run)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    t0, c0 = time.perf_counter(), _cpu_s()
    try:
        return (yield)
    finally:
        if fixturedef.scope == "function":
            node = request.node
            node._sft_own = [a + b for a, b in zip(getattr(node, "_sft_own", (0.0, 0.0)),
                                                     (time.perf_counter() - t0, _cpu_s() - c0))]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    c0 = _cpu_s()
    try:
        return (yield)
    finally:
        item._sft_call_cpu = _cpu_s() - c0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and report.passed and tier_of_nodeid(item.nodeid) == "unit":
        limit = _limit("SFT_UNIT_TEST_LIMIT_S", UNIT_TEST_LIMIT_S)
        fixture_wall, fixture_cpu = getattr(item, "_sft_own", (0.0, 0.0))
        cpu = getattr(item, "_sft_call_cpu", 0.0) + fixture_cpu
        wall = call.duration + fixture_wall
        if limit and (cpu > limit or wall > WALL_FACTOR * limit):
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} took {cpu:.1f} s of CPU and {wall:.1f} s of wall time (its call and its "
                               f"function-scoped fixtures): over the unit tier's limit of {limit:.0f} s of CPU or "
                               f"{WALL_FACTOR * limit:.0f} s of wall time a test (tests/helpers/budget.py). Make it "
                               "cheaper (a smaller model, fewer steps, a session fixture for what other tests build "
                               "too) or move it to tests/integration; docs/testing.md, \"Keeping the budget\".")
    return report


# ---------------------------------------------------------------------------------------------- the tier lines

class TierClock:
    """Per-tier counts, wall time and summed test time, fed with every test report (in the controller under xdist)."""

    def __init__(self):
        self.start = time.time()
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.outcomes: dict[str, dict[str, int]] = {}
        self.test_s: dict[str, dict[str, float]] = {}

    def add(self, report) -> None:
        tier = tier_of_nodeid(report.nodeid)
        if tier is None:
            return
        start, stop = getattr(report, "start", 0) or 0, getattr(report, "stop", 0) or 0
        if start:
            self.first[tier] = min(self.first.get(tier, start), start)
            self.last[tier] = max(self.last.get(tier, stop), stop)
        per_test = self.test_s.setdefault(tier, {})
        per_test[report.nodeid] = per_test.get(report.nodeid, 0.0) + (report.duration or 0.0)
        outcome = None
        if report.when == "call":
            outcome = report.outcome
        elif report.when == "setup" and not report.passed:
            outcome = "skipped" if report.skipped else "error"
        elif report.when == "teardown" and report.failed:
            outcome = "error"
        if outcome:
            counts = self.outcomes.setdefault(tier, {})
            counts[outcome] = counts.get(outcome, 0) + 1

    def lines(self) -> list[str]:
        out = []
        total = 0
        for tier in TIERS:
            if tier not in self.test_s:
                continue
            counts = self.outcomes.get(tier, {})
            n = len(self.test_s[tier])
            total += n
            detail = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            wall = self.last.get(tier, 0) - self.first.get(tier, 0)
            summed = sum(self.test_s[tier].values())
            out.append(f"tier {tier}: {n} tests ({detail}) in {_fmt(wall)} of wall time; {summed:.0f} s of test time")
        wall = time.time() - self.start
        out.append(f"total: {total} tests in {_fmt(wall)} of wall time (pytest's session)")
        return out

    def slowest(self, tier: str, n: int = 8) -> list[tuple[str, float]]:
        return sorted(self.test_s.get(tier, {}).items(), key=lambda kv: -kv[1])[:n]


class TierReport:
    """The controller's side (or the only process without xdist): counts every test report, checks the unit tier's
    budget at the end of the session and prints the tier lines."""

    def __init__(self, config):
        self.config = config
        self.clock = TierClock()
        self.over = ""

    def pytest_runtest_logreport(self, report):
        self.clock.add(report)

    def pytest_sessionfinish(self, session, exitstatus):
        """The unit tier's summed time against its budget; over it, the run fails (exit status 1)."""
        budget = _limit("SFT_UNIT_TIER_BUDGET_S", UNIT_TIER_BUDGET_S)
        unit_s = sum(self.clock.test_s.get("unit", {}).values())
        if budget and unit_s > budget:
            slow = ", ".join(f"{nodeid} {s:.1f} s" for nodeid, s in self.clock.slowest("unit"))
            self.over = (f"FAILED the unit tier's budget: its tests took {unit_s:.0f} s together, over {budget:.0f} s "
                         f"(tests/helpers/budget.py; SFT_UNIT_TIER_BUDGET_S changes it for a slower run). The slowest: "
                         f"{slow}. docs/testing.md, \"Keeping the budget\", says where such time should go.")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(trylast=True)  # after the durations table: the last lines above pytest's own closing line
    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_sep("-", "time per tier (tests/helpers/budget.py)")
        for line in self.clock.lines():
            terminalreporter.write_line(line)
        if self.over:
            terminalreporter.write_line(self.over, red=True)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller counts its reports
        config.pluginmanager.register(TierReport(config), "sft-tier-report")
