"""The suite's time budget (docs/testing.md "Keeping the budget"): a closing line per tier and the unit tier's guard.

Loaded by tests/conftest.py:

* **Per-tier lines.** At the end of every run pytest prints, just above its own closing line, one line per tier
  (unit, integration, cluster) with the tests it ran, their outcomes and the tier's wall time (from the start of its
  first test to the end of its last, in seconds; tiers overlap when tests run side by side), and a total line
  with the session's wall time. Under pytest-xdist the controller prints them from the workers' reports.
* **Each test's allowance.** A test whose own time (its call plus the setup of its function-scoped fixtures;
  session- and module-scoped fixtures, built once for many tests, are not counted) is over its tier's allowance
  (``LIMITS``: unit 5 s and integration 120 s of CPU time, this process and the subprocesses it waited for, or
  ``WALL_FACTOR`` times that of wall time, a test that waits; cluster 180 s of wall time) fails with a message naming
  the limit and the way out. CPU time, because wall time on a 2-core machine doubles whenever the other worker
  trains: the same test must not pass alone and fail beside a training run. An integration or cluster test that
  needs more says so and why: ``@pytest.mark.budget(SECONDS, reason="three 2-process runs: ...")`` gives it its own
  allowance (a unit test takes no mark: it moves to tests/integration). The unit tier's summed test time (less
  what its tests' setups spent building session- and module-scoped fixtures, paid once by whichever test runs
  first) over ``UNIT_TIER_BUDGET_S`` fails the run (exit status 1) with the slowest unit tests named. The limits
  hold on the slowest machine kind CI gets with room for the other worker's load; a slower run (coverage, a
  debugger) raises them with ``SFT_UNIT_TEST_LIMIT_S``, ``SFT_INTEGRATION_TEST_LIMIT_S``, ``SFT_CLUSTER_TEST_LIMIT_S`` /
  ``SFT_UNIT_TIER_BUDGET_S`` (seconds; 0 turns the check off; a budget mark is not raised).
* **CPU per tier.** Each test's CPU seconds travel with its report (``user_properties``), so the tier lines give
  the tier's CPU time too, and the end lists the tests nearest their allowance (the distribution the allowances
  are chosen from).
* Side by side: scripts/test.sh runs two pytest-xdist workers with ``--dist loadfile``: every test file runs whole
  in one worker, so a module-scoped fixture is built once, and the one SLURM cluster (tests/cluster/conftest.py,
  used by tests/cluster/test_slurm.py alone) is started once. (``--dist loadgroup`` with ``xdist_group`` marks does
  not group under pytest 9: xdist 3.8 writes the group into ``item._nodeid``, which pytest 9 no longer reads.)
"""
from __future__ import annotations

import os
import resource
import time
from typing import NamedTuple

import pytest

TIERS = ("unit", "integration", "cluster")
UNIT_TEST_LIMIT_S = 5.0
WALL_FACTOR = 3  # wall time may reach 3x the CPU limit (the other worker's load; a test that waits): 15 s in unit
UNIT_TIER_BUDGET_S = 180.0


class TierLimit(NamedTuple):
    """A tier's allowance per test: ``cpu_s`` seconds of CPU (this process and the subprocesses it waited for; None:
    not counted) and ``wall_s`` seconds of wall time, each raised by ``SFT_<TIER>_TEST_LIMIT_S`` (the CPU allowance,
    or the wall one where CPU is not counted; the other follows by ``WALL_FACTOR``; 0 turns the check off)."""
    cpu_s: float | None
    wall_s: float


# Chosen from CI's slowest tests (issue 55's fresh-clone run, wall time with both workers busy: integration 124 s at
# most, cluster 225 s) and the CPU measured for some of them (docs/testing.md "Where a test's time goes": the slowest
# ~100 s): the tests over them, or within ~20% of them (a machine kind's worse day), carry a budget mark. The tier
# lines and the list of tests nearest their allowance give the whole distribution of the next run. The cluster tier
# counts wall time only: its training runs under slurmd, sshd and Ray's daemons, not as this process's children,
# so their CPU time never reaches resource.getrusage(RUSAGE_CHILDREN).
LIMITS = {"unit": TierLimit(UNIT_TEST_LIMIT_S, WALL_FACTOR * UNIT_TEST_LIMIT_S),
          "integration": TierLimit(120.0, WALL_FACTOR * 120.0),
          "cluster": TierLimit(None, 180.0)}
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
        elif getattr(request, "_pyfuncitem", None) is not None:  # a shared fixture built in this test's setup
            item = request._pyfuncitem
            item._sft_shared = getattr(item, "_sft_shared", 0.0) + time.perf_counter() - t0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    c0 = _cpu_s()
    try:
        return (yield)
    finally:
        item._sft_call_cpu = _cpu_s() - c0


def allowance(item, tier: str) -> tuple[float | None, float | None, str]:
    """``(cpu_s, wall_s, where)`` for ``item`` of ``tier``: a ``@pytest.mark.budget(seconds, reason=...)`` test's own
    (``seconds`` of CPU, or of wall time in the cluster tier), else its tier's (``SFT_<TIER>_TEST_LIMIT_S`` raises it;
    0 or a 0 mark: no check, None)."""
    mark = item.get_closest_marker("budget")
    if mark is not None:
        seconds = float(mark.args[0])
        where = f"its budget mark ({mark.kwargs['reason']})"
    else:
        default = LIMITS[tier].cpu_s if LIMITS[tier].cpu_s is not None else LIMITS[tier].wall_s
        seconds = _limit(f"SFT_{tier.upper()}_TEST_LIMIT_S", default)
        where = f"the {tier} tier's allowance"
    if not seconds:
        return None, None, where
    if LIMITS[tier].cpu_s is None:
        return None, seconds, where
    return seconds, WALL_FACTOR * seconds, where


def _over(item, tier: str, cpu: float, wall: float) -> str | None:
    """The failure message of a test over its allowance, or None."""
    cpu_limit, wall_limit, where = allowance(item, tier)
    if not ((cpu_limit and cpu > cpu_limit) or (wall_limit and wall > wall_limit)):
        return None
    limits = " or ".join(f"{v:g} s of {k}" for k, v in (("CPU", cpu_limit), ("wall time", wall_limit)) if v)
    head = (f"{item.nodeid} took {cpu:.1f} s of CPU and {wall:.1f} s of wall time (its call and its function-scoped "
            f"fixtures): over {where}, {limits} a test (tests/helpers/budget.py). ")
    if tier == "unit":
        return head + ("Make it cheaper (a smaller model, fewer steps, a session fixture for what other tests build "
                       "too) or move it to tests/integration; docs/testing.md, \"Keeping the budget\".")
    return head + ("Make it cheaper (one run asserting several properties, the smallest model and the fewest steps "
                   "that prove it, a module fixture for a run other tests read) or, where the property needs the time, "
                   "mark it @pytest.mark.budget(SECONDS, reason=\"what takes the time\"); docs/testing.md, "
                   "\"Keeping the budget\".")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    tier = tier_of_nodeid(item.nodeid)
    if call.when == "setup" and getattr(item, "_sft_shared", 0.0):
        report.user_properties.append(("sft_shared_setup", round(item._sft_shared, 2)))
    if call.when == "call" and report.passed and tier is not None:
        fixture_wall, fixture_cpu = getattr(item, "_sft_own", (0.0, 0.0))
        cpu, wall = getattr(item, "_sft_call_cpu", 0.0) + fixture_cpu, call.duration + fixture_wall
        cpu_limit, wall_limit, _ = allowance(item, tier)
        # (own CPU s, own wall s, the share of its allowance used): the controller's tier lines and nearest list
        used = max(cpu / cpu_limit if cpu_limit else 0.0, wall / wall_limit if wall_limit else 0.0)
        report.user_properties.append(("sft_budget", (round(cpu, 2), round(wall, 2), round(used, 3))))
        message = _over(item, tier, cpu, wall)
        if message:
            report.outcome = "failed"
            report.longrepr = message
    return report


def check_budget_marks(items) -> None:
    """A ``budget`` mark needs its seconds and a reason, and only integration and cluster tests take one.

    Raises:
        pytest.UsageError: naming the test and what its mark lacks.
    """
    for item in items:
        mark = item.get_closest_marker("budget")
        if mark is None:
            continue
        tier = tier_of_nodeid(item.nodeid)
        seconds = mark.args[0] if len(mark.args) == 1 else None
        if tier == "unit":
            raise pytest.UsageError(f"{item.nodeid}: a unit test takes no budget mark; one over "
                                    f"{UNIT_TEST_LIMIT_S:.0f} s of CPU belongs in tests/integration")
        if not isinstance(seconds, (int, float)) or seconds < 0 or not str(mark.kwargs.get("reason", "")).strip():
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.budget(SECONDS, reason=\"what takes the time\") "
                                    f"needs a number of seconds and a reason, got {mark.args} {mark.kwargs}")


# ---------------------------------------------------------------------------------------------- the tier lines

class TierClock:
    """Per-tier counts, wall time and summed test time, fed with every test report (in the controller under xdist)."""

    def __init__(self):
        self.start = time.time()
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.outcomes: dict[str, dict[str, int]] = {}
        self.test_s: dict[str, dict[str, float]] = {}
        self.cpu_s: dict[str, float] = {}
        self.used: dict[str, tuple[float, float, float]] = {}  # nodeid -> (CPU s, wall s, share of its allowance)
        self.shared_s: dict[str, float] = {}  # tier -> wall s its tests' setups spent building shared fixtures

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
        for key, value in getattr(report, "user_properties", ()):
            if key == "sft_budget":
                self.used[report.nodeid] = tuple(value)
                self.cpu_s[tier] = self.cpu_s.get(tier, 0.0) + value[0]
            elif key == "sft_shared_setup":
                self.shared_s[tier] = self.shared_s.get(tier, 0.0) + value
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
            cpu = f" ({self.cpu_s[tier]:.0f} s of CPU in the tests' own time)" if tier in self.cpu_s else ""
            shared = (f", of which {self.shared_s[tier]:.0f} s building session and module fixtures"
                      if self.shared_s.get(tier, 0.0) >= 0.5 else "")
            out.append(f"tier {tier}: {n} tests ({detail}) in {_fmt(wall)} of wall time; {summed:.0f} s of test "
                       f"time{shared}{cpu}")
        wall = time.time() - self.start
        out.append(f"total: {total} tests in {_fmt(wall)} of wall time (pytest's session)")
        return out

    def nearest(self, n: int = 5) -> list[str]:
        """The integration and cluster tests nearest their allowance (over half of it), most used first."""
        rows = sorted(((u, nodeid, cpu, wall) for nodeid, (cpu, wall, u) in self.used.items()
                       if u >= 0.5 and tier_of_nodeid(nodeid) in ("integration", "cluster")), reverse=True)
        return [f"  {u:.0%} of its allowance: {nodeid} ({cpu:.0f} s of CPU, {wall:.0f} s of wall time)"
                for u, nodeid, cpu, wall in rows[:n]]

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
        # the shared fixtures' building (test assets, the converted example) is paid once, by whichever test of
        # whichever tier the scheduler runs first: not the unit tests' own time
        unit_s = sum(self.clock.test_s.get("unit", {}).values()) - self.clock.shared_s.get("unit", 0.0)
        if budget and unit_s > budget:
            slow = ", ".join(f"{nodeid} {s:.1f} s" for nodeid, s in self.clock.slowest("unit"))
            self.over = (f"FAILED the unit tier's budget: its tests took {unit_s:.0f} s together (besides building "
                         f"session and module fixtures), over {budget:.0f} s "
                         f"(tests/helpers/budget.py; SFT_UNIT_TIER_BUDGET_S changes it for a slower run). The slowest: "
                         f"{slow}. docs/testing.md, \"Keeping the budget\", says where such time should go.")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(trylast=True)  # after the durations table: the last lines above pytest's own closing line
    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_sep("-", "time per tier (tests/helpers/budget.py)")
        for line in self.clock.lines():
            terminalreporter.write_line(line)
        nearest = self.clock.nearest()
        if nearest:
            terminalreporter.write_line("nearest their allowance (@pytest.mark.budget or LIMITS in tests/helpers/"
                                        "budget.py):")
            for line in nearest:
                terminalreporter.write_line(line)
        if self.over:
            terminalreporter.write_line(self.over, red=True)


def pytest_collection_modifyitems(items):
    check_budget_marks(items)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller counts its reports
        config.pluginmanager.register(TierReport(config), "sft-tier-report")
