"""A real SLURM cluster and a real sshd per host across namespace hosts (see :mod:`tests.helpers.netns`).

``Cluster(hosts)`` starts, all under one private folder ``/tmp/sftslurm-*``:

- one ``munged`` on this machine (its own key, socket, pid, log and seed files), reachable from every host
  through its Unix socket (the hosts share the file system);
- ``slurmctld -D`` on host 0 and ``slurmd -D -N nodeI`` on every host, from a generated ``slurm.conf``
  (``SLURM_CONF`` points daemons and clients at it): root as SlurmUser, proctrack/linuxproc, task/none, no
  accounting, ``cred_expire=10`` and short scheduler intervals so a requeued job runs again after ~10 s
  instead of ~140 s, ``SlurmdTimeout=10`` so a dead node is noticed in ~15 s;
- ``sshd -D`` on every host (its own host key, key-only root login, listening on the host's address only)
  and a client config (``ssh -F``) with the one identity that every sshd accepts.

:meth:`Cluster.close` (also called when starting fails) kills every daemon it started and every process
left in the namespaces, removes the namespaces, the private folder and any ``/sys/fs/cgroup/*/slurm*``
folder the daemons made. :meth:`Cluster.leftovers` lists what would still be there (empty after close()).
The facts this relies on (cgroup mount, requeue hold, signal reach) are in docs/testing.md.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

from tests.helpers import netns

SBIN = "/usr/sbin"
CGROUPS = "/sys/fs/cgroup/*/slurm*"


def unavailable() -> str | None:
    """Why a cluster cannot be started here (not root, no namespaces, tools that cannot be installed), or None.
    Installs the missing tools with scripts/install_cluster_tools.sh (apt-get) first."""
    why = netns.unavailable()
    if why:
        return why
    from tests.helpers.paths import ROOT

    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_cluster_tools.sh")], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        return f"SLURM, munge or sshd missing and not installable: {r.stderr.strip()[-300:]}"
    return None


def _conf(d: str, hosts: netns.Hosts, cpus: int) -> str:
    nodes = "".join(f"NodeName={h} NodeAddr={a} NodeHostname={h} CPUs={cpus} State=UNKNOWN\n"
                    for h, a in zip(hosts.hostnames, hosts.addrs))
    return f"""ClusterName=sft
SlurmctldHost={hosts.hostnames[0]}({hosts.addrs[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long (default 120 s) before it may start again
AuthInfo=socket={d}/munge/munge.socket,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
InactiveLimit=0
KillWait=30
MinJobAge=600
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
{nodes}PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _sshd_config(d: str, addr: str, i: int) -> str:
    return f"""ListenAddress {addr}
Port 22
HostKey {d}/ssh/host{i}_ed25519
PidFile {d}/ssh/sshd{i}.pid
AuthorizedKeysFile {d}/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
AcceptEnv LANG
"""


class Cluster:
    """SLURM (munged, slurmctld on host 0, slurmd per host) and sshd per host, on ``hosts``; ``env()`` is the
    environment for SLURM clients and ``ssh`` (``SLURM_CONF``); ``ssh_config`` is the file for ``ssh -F``."""

    def __init__(self, hosts: netns.Hosts, cpus: int = 2):
        self.hosts = hosts
        self.dir = tempfile.mkdtemp(prefix="sftslurm-", dir="/tmp")
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.ssh_config = os.path.join(self.dir, "ssh", "config")
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._cgroups_before = set(glob.glob(CGROUPS))
        try:
            self._start(cpus)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------- start

    def _spawn(self, name: str, argv: list[str], host: int | None = None, private_run: bool = False):
        log = open(os.path.join(self.dir, f"{name}.out"), "w")
        cmd = argv if host is None else self.hosts.cmd(host, argv, private_run=private_run)
        p = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, p))
        return p

    def _start(self, cpus: int) -> None:
        d = self.dir
        for sub in ("munge", "state", "ssh", *(f"spool/{h}" for h in self.hosts.hostnames)):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        os.chmod(os.path.join(d, "munge"), 0o755)  # munged: its socket folder must be 755, its key 700/600
        key = os.path.join(d, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        self._spawn("munged", [f"{SBIN}/munged", "-F", "-f", f"--socket={d}/munge/munge.socket", f"--key-file={key}",
                               f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munge/munged.log",
                               f"--seed-file={d}/munge/munged.seed"])
        self._wait_for(lambda: os.path.exists(f"{d}/munge/munge.socket"), "munged's socket", "munged")
        with open(self.conf, "w") as f:
            f.write(_conf(d, self.hosts, cpus))
        self._spawn("slurmctld", [f"{SBIN}/slurmctld", "-D", "-i", "-f", self.conf], host=0)
        for i, h in enumerate(self.hosts.hostnames):
            self._spawn(f"slurmd-{h}", [f"{SBIN}/slurmd", "-D", "-N", h, "-f", self.conf], host=i)
        self._start_sshd()
        self._wait_for(self._all_idle, "every node idle in sinfo", "slurmctld")
        self._wait_for(self._all_ssh, "ssh login on every host", "sshd-" + self.hosts.hostnames[-1])

    def _start_sshd(self) -> None:
        s = os.path.join(self.dir, "ssh")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{s}/id_ed25519"], check=True)
        shutil.copy(f"{s}/id_ed25519.pub", f"{s}/authorized_keys")
        with open(self.ssh_config, "w") as f:
            f.write(f"Host *\n  IdentityFile {s}/id_ed25519\n  User root\n  StrictHostKeyChecking no\n"
                    "  UserKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n  ConnectTimeout 10\n")
        for i, addr in enumerate(self.hosts.addrs):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{s}/host{i}_ed25519"], check=True)
            with open(f"{s}/sshd{i}.conf", "w") as f:
                f.write(_sshd_config(self.dir, addr, i))
            self._spawn(f"sshd-{self.hosts.hostnames[i]}", [f"{SBIN}/sshd", "-D", "-e", "-f", f"{s}/sshd{i}.conf"],
                        host=i, private_run=True)

    def _all_idle(self) -> bool:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return all(states.get(h) == "idle" for h in self.hosts.hostnames)

    def _all_ssh(self) -> bool:
        """Every host's sshd accepts the key: ``ssh -F config nodeI true`` from host 0 succeeds for each."""
        for h in self.hosts.hostnames:
            r = subprocess.run(self.hosts.cmd(0, ["ssh", "-F", self.ssh_config, h, "true"]), capture_output=True,
                               timeout=30)
            if r.returncode != 0:
                return False
        return True

    def _wait_for(self, ok, what: str, log: str, limit: float = 60) -> None:
        deadline = time.monotonic() + limit
        while not ok():
            dead = [n for n, p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"cluster: no {what} within {limit} s (exited: {dead}):\n{self.log(log)[-2000:]}")
            time.sleep(0.2)

    # ----------------------------------------------------------------------------------------- clients

    # The test process's own launch variables (conftest gives each pytest-xdist worker a MASTER_PORT) are not the
    # cluster's: sbatch exports the caller's environment into the job, where they would override what the job
    # derives from SLURM (its master port from the job id).
    _NOT_EXPORTED = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE")

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in self._NOT_EXPORTED}
        env["SLURM_CONF"] = self.conf
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, scontrol, scancel, sinfo ...) on host ``host`` (the cluster's addresses
        exist only in the namespaces), against this cluster."""
        host = kw.pop("host", 0)
        return subprocess.run(self.hosts.cmd(host, argv), env=kw.pop("env", self.env()), capture_output=True,
                              text=True, check=check, timeout=60, **kw)

    def sbatch(self, argv: list[str], env: dict, cwd: str) -> int:
        """``sbatch --parsable ARGV`` on host 0 from ``cwd`` with ``env``; the job id."""
        r = subprocess.run(self.hosts.cmd(0, ["sbatch", "--parsable", *argv]), env=env, cwd=cwd,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"sbatch failed: {r.stderr}"
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, states: tuple[str, ...], limit: float) -> dict:
        """Polls the job until its JobState is one of ``states``; its record. Fails after ``limit`` seconds."""
        deadline = time.monotonic() + limit
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not in {states} after {limit} s: {info}")
            time.sleep(0.5)

    def log(self, name: str) -> str:
        for path in (os.path.join(self.dir, f"{name}.log"), os.path.join(self.dir, f"{name}.out")):
            if os.path.exists(path):
                return open(path, errors="replace").read()
        return ""

    def daemons(self) -> dict[str, list[int]]:
        """Running slurmctld / slurmd / sshd / munged processes of this cluster, by name (from /proc)."""
        found: dict[str, list[int]] = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            text = b" ".join(argv).decode(errors="replace")
            if self.dir in text and argv[0]:
                found.setdefault(os.path.basename(argv[0].decode().split()[0].rstrip(":")), []).append(int(pid))
        return found

    # ------------------------------------------------------------------------------------- node crash

    def crash(self, i: int) -> list[int]:
        """What a crashed host does to SLURM: SIGKILL to host ``i``'s slurmd and to every other process in its
        namespace (slurmstepd, the job's launcher, torchrun, the workers) except sshd (not SLURM's). The pids."""
        keep = set(self.daemons().get("sshd", []))
        pids = [p for p in self.hosts.pids(i) if p not in keep]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def restart_slurmd(self, i: int, limit: float = 90) -> None:
        """Starts host ``i``'s slurmd again (after :meth:`crash`) and waits until every node is idle
        (``ReturnToService=2``: a down node returns once its slurmd registers)."""
        name = f"slurmd-{self.hosts.hostnames[i]}"
        for entry in [e for e in self.procs if e[0] == name]:
            if entry[1].poll() is None:
                os.killpg(entry[1].pid, signal.SIGKILL)
            entry[1].wait()
            self.procs.remove(entry)
        self._spawn(name, [f"{SBIN}/slurmd", "-D", "-N", self.hosts.hostnames[i], "-f", self.conf], host=i)
        self._wait_for(self._all_idle, f"every node idle in sinfo after restarting {name}", name, limit)

    # ----------------------------------------------------------------------------------------- cleanup

    def close(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for _, p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.hosts.close()  # every process still in the namespaces (job steps) is killed with them
        for pid in sum(self.daemons().values(), []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for folder in self.cgroups():
            try:
                os.rmdir(folder)
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def cgroups(self) -> list[str]:
        """cgroup folders named slurm* made since this cluster started (deepest first)."""
        return sorted(set(glob.glob(CGROUPS)) - self._cgroups_before, reverse=True)

    def leftovers(self) -> list[str]:
        """What close() should have removed and is still there: namespaces, daemons, cgroups, files."""
        left = [f"namespace {ns}" for ns in self.hosts.leftovers()]
        left += [f"{name} pid {pid}" for name, pids in self.daemons().items() for pid in pids]
        left += [f"cgroup {c}" for c in self.cgroups()]
        left += [f"folder {p}" for p in (self.dir, self.hosts.tmp) if os.path.exists(p)]
        return left
