"""The cluster tier's one real cluster per test session: 3 namespace hosts running SLURM (munged, slurmctld,
slurmd per host) and sshd per host (tests/helpers/slurm.py). Started on first use, stopped and removed at
the end of the session, also when a test failed; the teardown checks that nothing is left behind."""
import subprocess

import pytest


@pytest.fixture(scope="session")
def cluster():
    from tests.helpers import netns, slurm, tails

    why = slurm.unavailable()  # root, namespaces; installs SLURM/munge/sshd when missing
    if why:
        pytest.skip(why)
    hosts = netns.Hosts(3, tag="slurm")
    c = slurm.Cluster(hosts)  # stops what it started and removes the hosts if it cannot start
    tails.watch(c.dir)  # a failed test shows the daemons' logs (slurmctld, slurmd per host) written while it ran
    try:
        yield c
    finally:
        tails.unwatch(c.dir)
        c.close()
        assert not c.leftovers(), f"left behind by the cluster: {c.leftovers()}"
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [ns for ns in [hosts.switch, *hosts.names] if ns in listed.split()], listed
        ours = subprocess.run(["pgrep", "-af", c.dir], capture_output=True, text=True).stdout
        assert not ours.strip(), f"daemons of the cluster still running: {ours}"
