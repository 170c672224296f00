"""A real Ray cluster for tests: ``ray start --head`` on namespace host 0 and ``ray start --address`` on the
others (see :mod:`tests.helpers.netns`), each node with its own address, host name and ``--temp-dir``.

Ray's processes live in the hosts' network namespaces, so :meth:`netns.Hosts.close` (which kills every process
left in them) stops them all; :meth:`RayCluster.close` does that through the hosts it was given, removes its temp
dirs and the ``/tmp/ray/ray_current_cluster`` address file when it names this cluster (a stale one would make a
later ``ray.init()`` on this machine try to join a cluster that is gone). ``ray stop`` is not used: it kills Ray
processes by name on the whole machine, not only this cluster's.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile

from tests.helpers import netns

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
GCS_PORT = 6379
ADDRESS_FILE = "/tmp/ray/ray_current_cluster"


class RayCluster:
    """Ray on every host of ``hosts``; ``cpus[i]`` logical CPUs on host i. ``address`` is the head's GCS address."""

    def __init__(self, hosts: netns.Hosts, cpus: list[int]):
        self.hosts = hosts
        self.address = f"{hosts.addrs[0]}:{GCS_PORT}"
        # short: Ray's unix sockets live under it and socket paths are limited to 107 bytes
        self.tmp = tempfile.mkdtemp(prefix="sftray", dir="/tmp")
        # Ray's token authentication, as on a real cluster: one token shared by every node and the driver
        # (explicit, so a token left in ~/.ray by some local Ray cannot switch it on for the head alone).
        self.token_path = os.path.join(self.tmp, "auth_token")
        with open(self.token_path, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            for i, n in enumerate(cpus):
                role = (["--head", "--port", str(GCS_PORT), "--include-dashboard", "false"] if i == 0
                        else ["--address", self.address])
                self._run(i, [RAY, "start", *role, "--node-ip-address", hosts.addrs[i], "--num-cpus", str(n),
                              "--num-gpus", "0", "--object-store-memory", str(80 * 2**20),
                              "--temp-dir", os.path.join(self.tmp, f"n{i}"), "--disable-usage-stats"])
        except BaseException:
            self.close()
            raise

    def env(self, **extra) -> dict:
        """Environment for Ray commands and drivers of this cluster: its token, no usage stats, the interpreter's
        bin folder first on PATH, one thread per process."""
        e = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        e.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path,
                  "OMP_NUM_THREADS": "1",
                  "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
        e.update({k: str(v) for k, v in extra.items()})
        return e

    def _run(self, i: int, argv: list[str]) -> None:
        r = subprocess.run(self.hosts.cmd(i, argv), env=self.env(), capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} on {self.hosts.hostnames[i]} failed ({r.returncode}):\n"
                               f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")

    def node_ids(self) -> dict[str, str]:
        """``{node address: Ray node id}`` of the alive nodes, read from Ray by a driver on the head."""
        code = ("import json, ray; ray.init(address=%r, logging_level='ERROR'); "
                "print(json.dumps({n['NodeManagerAddress']: n['NodeID'] for n in ray.nodes() if n['Alive']}))"
                % self.address)
        r = subprocess.run(self.hosts.cmd(0, [sys.executable, "-c", code]), env=self.env(), capture_output=True,
                           text=True, timeout=180)
        if r.returncode != 0:
            raise RuntimeError(f"listing the nodes failed ({r.returncode}):\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def drain(self, i: int, deadline_s: int = 120) -> None:
        """``ray drain-node`` for host i with reason PREEMPTION, as Ray's autoscaler does for a reclaimed spot node."""
        self._run(0, [RAY, "drain-node", "--address", self.address, "--node-id", self.node_ids()[self.hosts.addrs[i]],
                      "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot instance reclaimed (test)",
                      "--deadline-remaining-seconds", str(deadline_s)])

    def processes(self) -> list[str]:
        """Command lines of live processes that belong to this cluster (Ray's daemons name its temp dir)."""
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if self.tmp in cmd:
                found.append(f"{pid}: {cmd[:200]}")
        return found

    def close(self) -> None:
        self.hosts.close()
        try:
            with open(ADDRESS_FILE) as f:
                if f.read().strip() == self.address:
                    os.remove(ADDRESS_FILE)
        except OSError:
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)
