"""The per-test allowances of tests/helpers/budget.py, on stand-in test items (no pytest run inside a test): a test over
its tier's allowance fails with the way out named, a budget mark gives its own allowance and needs a reason, a unit
test takes no mark, the cluster tier counts wall time only."""
import pytest

from tests.helpers import budget


class Mark:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class Item:
    def __init__(self, nodeid, mark=None):
        self.nodeid, self.mark = nodeid, mark

    def get_closest_marker(self, name):
        return self.mark if name == "budget" else None


INTEGRATION, CLUSTER, UNIT = "tests/integration/x/test_a.py::test_b", "tests/cluster/test_c.py::test_d", \
    "tests/unit/test_e.py::test_f"


def test_each_tier_has_its_allowance_and_a_mark_its_own(monkeypatch):
    for env in ("SFT_UNIT_TEST_LIMIT_S", "SFT_INTEGRATION_TEST_LIMIT_S", "SFT_CLUSTER_TEST_LIMIT_S"):
        monkeypatch.delenv(env, raising=False)
    assert budget.allowance(Item(UNIT), "unit")[:2] == (5.0, 15.0)
    assert budget.allowance(Item(INTEGRATION), "integration")[:2] == (120.0, 360.0)
    assert budget.allowance(Item(CLUSTER), "cluster")[:2] == (None, 180.0)  # wall time only
    marked = Item(INTEGRATION, Mark(300, reason="three runs"))
    assert budget.allowance(marked, "integration") == (300.0, 900.0, "its budget mark (three runs)")
    assert budget.allowance(Item(CLUSTER, Mark(330, reason="r")), "cluster")[:2] == (None, 330.0)
    monkeypatch.setenv("SFT_INTEGRATION_TEST_LIMIT_S", "0")
    assert budget.allowance(Item(INTEGRATION), "integration")[:2] == (None, None)  # the check off
    assert budget.allowance(marked, "integration")[0] == 300.0  # a mark is not raised by the environment


def test_over_the_allowance_names_the_limit_and_the_way_out(monkeypatch):
    monkeypatch.delenv("SFT_INTEGRATION_TEST_LIMIT_S", raising=False)
    monkeypatch.delenv("SFT_CLUSTER_TEST_LIMIT_S", raising=False)
    assert budget._over(Item(INTEGRATION), "integration", cpu=119.0, wall=200.0) is None
    message = budget._over(Item(INTEGRATION), "integration", cpu=121.0, wall=200.0)
    assert "121.0 s of CPU" in message and "120 s of CPU or 360 s of wall time" in message
    assert "@pytest.mark.budget(SECONDS" in message
    assert budget._over(Item(INTEGRATION), "integration", cpu=10.0, wall=361.0) is not None  # a test that waits
    assert budget._over(Item(INTEGRATION, Mark(300, reason="r")), "integration", cpu=250.0, wall=300.0) is None
    assert budget._over(Item(CLUSTER), "cluster", cpu=1000.0, wall=170.0) is None
    assert "180 s of wall time" in budget._over(Item(CLUSTER), "cluster", cpu=0.0, wall=181.0)
    assert "move it to tests/integration" in budget._over(Item(UNIT), "unit", cpu=5.5, wall=6.0)


@pytest.mark.parametrize("item,why", [
    (Item(INTEGRATION, Mark(300)), "needs a number of seconds and a reason"),
    (Item(INTEGRATION, Mark(reason="r")), "needs a number of seconds and a reason"),
    (Item(CLUSTER, Mark("300", reason="r")), "needs a number of seconds and a reason"),
    (Item(UNIT, Mark(10, reason="r")), "belongs in tests/integration"),
])
def test_a_budget_mark_needs_seconds_a_reason_and_a_slower_tier(item, why):
    with pytest.raises(pytest.UsageError, match=why):
        budget.check_budget_marks([item])
    budget.check_budget_marks([Item(INTEGRATION, Mark(300, reason="three runs")), Item(UNIT)])


def _report(nodeid, when, duration, props=()):
    from types import SimpleNamespace

    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration, start=1.0, stop=1.0 + duration,
                           user_properties=list(props), outcome="passed", passed=True, skipped=False, failed=False)


def test_the_unit_tier_budget_leaves_out_building_shared_fixtures(monkeypatch):
    """A unit test whose setup built a session fixture (a test asset) pays that once for every tier: the tier line
    names it, and the unit budget counts the tests' own time without it."""
    from types import SimpleNamespace

    monkeypatch.setenv("SFT_UNIT_TIER_BUDGET_S", "100")
    rep = budget.TierReport(config=None)
    for r in (_report("tests/unit/a.py::t", "setup", 77.4, [("sft_shared_setup", 77.3)]),
              _report("tests/unit/a.py::t", "call", 40.0), _report("tests/unit/b.py::u", "call", 50.0)):
        rep.pytest_runtest_logreport(r)
    session = SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    rep.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.OK and not rep.over  # 167.4 - 77.3 = 90.1 s of its own
    assert "167 s of test time, of which 77 s building session and module fixtures" in rep.clock.lines()[0]
    rep.pytest_runtest_logreport(_report("tests/unit/c.py::v", "call", 10.0))
    rep.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    assert "took 100 s together (besides building session and module fixtures), over 100 s" in rep.over
