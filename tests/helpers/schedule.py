"""Which pytest-xdist worker runs which test file: the cluster tier on a worker of its own, beside the others.

The cluster tier (tests/cluster: namespace hosts running real SLURM, sshd and Ray) spends much of its time waiting
on daemons, timeouts and rendezvous, while unit and integration tests compute. Run after the others (xdist's order),
its waits leave cores idle; run beside them, the computing tests use those cores. So with 3 or more workers and
``--dist loadfile``, the last worker takes the cluster tier's files first and every other worker takes unit and
integration files first; a worker whose kind has run out takes the other kind, so no worker idles while files wait.
Files stay whole, as under ``--dist loadfile`` (a module-scoped fixture, the one SLURM cluster: built once). Within
a kind, xdist's own order (most tests first). With fewer than 3 workers or another ``--dist`` mode: xdist's own
scheduling, unchanged. scripts/test.sh starts 3 workers when the run includes the cluster tier.

pytest-xdist's scheduler internals are used here and nowhere else: ``LoadScopeScheduling.workqueue`` (an ordered
dict of file -> its tests) and ``_assign_work_unit`` (checked against pytest-xdist 3.8.0).
"""
from __future__ import annotations

CLUSTER = "tests/cluster/"


def is_cluster_file(scope: str) -> bool:
    """A work unit (a test file's node id prefix, e.g. ``tests/cluster/test_slurm.py``) of the cluster tier."""
    return scope.replace("\\", "/").startswith(CLUSTER)


def make_scheduler(config, log):
    """The scheduler for ``--dist loadfile`` with 3 or more workers (see the module docstring); None otherwise, which
    leaves the choice to xdist (the ``pytest_xdist_make_scheduler`` hook is firstresult)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ClusterBeside(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            nodes = sorted(self.nodes, key=lambda n: int(n.gateway.id.lstrip("gw") or 0))
            if len(nodes) >= 3:
                wants_cluster = node is nodes[-1]
                pick = next((s for s in self.workqueue if is_cluster_file(s) == wants_cluster), None)
                if pick is not None:
                    self.workqueue.move_to_end(pick, last=False)  # the base class pops the first unit
            super()._assign_work_unit(node)

    return ClusterBeside(config, log)
