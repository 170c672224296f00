"""Separate network hosts for multi-node tests: Linux network namespaces joined by a bridge.

``Hosts(n)`` makes ``n`` namespaces ``sft<pid>h<i>`` (host names ``node0`` .. ``node<n-1>``, addresses
``10.213.0.<i+1>/24`` that exist only inside them, loopback up) and one ``sft<pid>sw`` namespace holding
the bridge that joins their veth pairs, so nothing is added to the machine's own network namespace.
Each command runs as ``nsenter --net=/run/netns/NS unshare --uts --mount --propagation private``: its own
host name, and in its own mount namespace a private hosts file bind-mounted over ``/etc/hosts`` (every host
resolves the others by name; the machine's own ``/etc/hosts`` is untouched) and, with ``private_run``, a
tmpfs on ``/run`` (sshd's ``/run/sshd``). Not ``ip netns exec``: it remounts ``/sys``, which hides
``/sys/fs/cgroup`` and slurmd then refuses to start. Those mounts end with the last process of the command.

Cleanup (``close()``, also on errors and from the pytest fixture's finally): kill every process left in
the namespaces, delete them (which deletes the veths, the bridge and the /run/netns bind mounts) and the
hosts file's folder.
Needs root and iproute2; :func:`unavailable` says why not when they are missing.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """The reason namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter"):
        if not shutil.which(tool):
            return f"{tool} (iproute2 / util-linux) is not installed"
    name = f"sft{os.getpid()}probe"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def kill_groups(procs, wait: bool = True) -> None:
    """SIGKILL the process group of every ``subprocess.Popen`` in ``procs`` that is still running (each started
    with ``start_new_session=True`` / its own group: a launcher, its agent and workers go together), then reap it
    unless ``wait`` is False. Never raises for a group that is already gone."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if wait:
                p.wait()


class Hosts:
    """``n`` namespace hosts on one private bridge. ``names[i]``, ``addrs[i]``, ``hostnames[i]``; ``cmd(i, argv)``."""

    def __init__(self, n: int, tag: str = ""):
        self.prefix = f"sft{os.getpid()}{tag}"
        self.switch = f"{self.prefix}sw"
        self.names = [f"{self.prefix}h{i}" for i in range(n)]
        self.hostnames = [f"node{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.made: list[str] = []
        self.tmp = tempfile.mkdtemp(prefix=f"{self.prefix}-", dir="/tmp")
        self.hosts_file = os.path.join(self.tmp, "hosts")
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addrs, self.hostnames))
        with open(self.hosts_file, "w") as f:
            f.write(hosts)
        for i, ns in enumerate(self.names):
            self._add_ns(ns)
            inner, outer = f"v{os.getpid() % 100000}x{i}", f"v{os.getpid() % 100000}y{i}"  # <= 15 chars
            _ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", outer, "master", "br0")
            _ip("-n", self.switch, "link", "set", outer, "up")
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            up = _ip("-n", ns, "-o", "link", "show", "lo").stdout
            assert "UP" in up or "UNKNOWN" in up, f"loopback is down in {ns}: {up}"

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)

    def cmd(self, i: int, argv: list[str], private_run: bool = False) -> list[str]:
        """argv run on host ``i``: its network namespace, its own host name and ``/etc/hosts``; with
        ``private_run`` a fresh tmpfs on ``/run`` holding an empty ``/run/sshd``."""
        setup = 'hostname "$0" && mount --bind "$1" /etc/hosts'
        if private_run:
            setup += " && mount -t tmpfs -o mode=755 sft-run /run && mkdir -m 755 /run/sshd"
        return ["nsenter", f"--net=/run/netns/{self.names[i]}", "unshare", "--uts", "--mount", "--propagation",
                "private", "--", "bash", "-c", setup + ' && shift && exec "$@"', self.hostnames[i],
                self.hosts_file, *argv]

    def pids(self, i: int) -> list[int]:
        r = _ip("netns", "pids", self.names[i], check=False)
        return [int(x) for x in r.stdout.split()]

    def close(self) -> None:
        for ns in self.made:
            for sig in (signal.SIGKILL,):
                for pid in [int(x) for x in _ip("netns", "pids", ns, check=False).stdout.split()]:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        time.sleep(0.1)
        for ns in reversed(self.made):
            _ip("netns", "del", ns, check=False)
        self.made = []
        shutil.rmtree(self.tmp, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Namespaces of this object still present (empty after close())."""
        listed = _ip("netns", "list", check=False).stdout
        return [ns for ns in [self.switch, *self.names] if ns in listed.split()]
