"""tests/helpers/schedule.py: with 3 pytest-xdist workers the cluster tier's files go to the last worker and the
other tiers' files to the others, each file whole; a worker whose kind has run out takes the other kind."""
from types import SimpleNamespace

from tests.helpers import schedule


class _Config:
    option = SimpleNamespace(loadscopereorder=False)

    def __init__(self, workers: int):
        self.workers = workers

    def getvalue(self, name):
        return {"dist": "loadfile", "tx": [f"{self.workers}*popen"]}[name]


class _Node:
    def __init__(self, i):
        self.gateway, self.shutting_down, self.sent = SimpleNamespace(id=f"gw{i}"), False, []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


COLLECTION = [f"tests/unit/test_{c}.py::t{i}" for c in "abcd" for i in range(2)] + [
    "tests/integration/test_e.py::t0", "tests/cluster/test_x.py::t0", "tests/cluster/test_x.py::t1",
    "tests/cluster/test_y.py::t0"]


def _files_per_worker(workers: int) -> list[set]:
    sched = schedule.make_scheduler(_Config(workers), None)
    nodes = [_Node(i) for i in range(workers)]
    for n in reversed(nodes):  # the order workers report ready in is not the order of their ids
        sched.add_node(n)
    for n in nodes:
        sched.add_node_collection(n, COLLECTION)
    sched.schedule()
    for _ in range(4):  # each worker finishes what it was given and asks for more, until nothing is left
        for n in nodes:
            for i in list(n.sent):
                if not sched.assigned_work[n][COLLECTION[i].split("::")[0]][COLLECTION[i]]:
                    sched.mark_test_complete(n, i)
    return [{COLLECTION[i].split("::")[0] for i in n.sent} for n in nodes]


def test_the_cluster_tier_gets_the_last_of_three_workers_and_every_file_runs_once():
    files = _files_per_worker(3)
    assert files[2] >= {"tests/cluster/test_x.py", "tests/cluster/test_y.py"}, files
    assert not any(schedule.is_cluster_file(f) for f in files[0] | files[1]), files
    assert sorted(sum((sorted(f) for f in files), [])) == sorted({c.split("::")[0] for c in COLLECTION})


def test_two_workers_keep_xdists_own_order():
    files = _files_per_worker(2)
    assert sorted(sum((sorted(f) for f in files), [])) == sorted({c.split("::")[0] for c in COLLECTION})
    assert schedule.make_scheduler(SimpleNamespace(getvalue=lambda name: "load"), None) is None
