"""The launcher's environment contract: one node's view of the job, validated in one place (stdlib only).

:func:`read_contract` reads ``NNODES`` (1), ``NODE_RANK`` (0), ``MASTER_ADDR`` (localhost),
``MASTER_PORT`` (6001), ``GPUS_PER_NODE`` (every visible GPU) or, without GPUs, ``NPROC_PER_NODE`` (1),
``RDZV_TIMEOUT`` (600 s) and reports every broken rule at once. ``NNODES=MIN:MAX`` asks for an elastic job
(torchrun's c10d rendezvous, restarts on a lost or joining node: :class:`Elastic`), with ``MAX_RESTARTS`` (3)
and ``RDZV_ID`` (the SLURM or PBS job id, else ``sft``). :func:`choose_interface` picks the network
interface gloo should use. ``finetune/launch.sh`` evaluates both through ``python -m sft.distributed plan``
(see :mod:`sft.distributed.__main__`); nothing here imports torch, so the launcher does not pay for it.
:func:`scheduler_nnodes` gives the SLURM and PBS scripts the ``NNODES`` of every node (``MIN_NODES`` asks for
an elastic job over the scheduler's nodes).
"""
from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
from dataclasses import dataclass
from typing import Mapping, Optional

from sft.errors import ContractError

DEFAULT_MASTER_PORT = 6001
DEFAULT_RDZV_TIMEOUT_S = 600  # torch's static rendezvous default is 600 s too
DEFAULT_MAX_RESTARTS = 3
# c10d rendezvous settings for an elastic job (measured on 3 namespace hosts, torch 2.13: survivors of a killed
# node re-rendezvoused in ~7 s with these, ~46 s with torch's defaults 30 s / 5 s x 3)
ELASTIC_RDZV_CONF = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3}
DEFAULT_LAST_CALL_S = 3  # once MIN nodes have joined, a round waits this long for more (torch's default: 30)

_UINT = re.compile(r"^(0|[1-9][0-9]{0,8})$")  # decimal, no leading zeros, no overflow
_RDZV_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class Elastic:
    """An elastic job (``NNODES=MIN:MAX``): torchrun's c10d rendezvous on ``MASTER_ADDR:MASTER_PORT``, served by
    the launcher of the host that owns ``MASTER_ADDR`` (``store_host``; that host must not be lost), between
    ``min_nodes`` and the contract's ``nnodes`` (the maximum) nodes, up to ``max_restarts`` restarts of the
    worker group on a failure (a node joining between rounds restarts it too and does not count)."""

    min_nodes: int
    max_restarts: int
    rdzv_id: str
    store_host: bool
    last_call_s: int = DEFAULT_LAST_CALL_S

    def rdzv_conf(self, timeout_s: int) -> str:
        """torchrun's ``--rdzv_conf`` value: the join timeout (``RDZV_TIMEOUT``), the last call
        (``RDZV_LAST_CALL_TIMEOUT``), :data:`ELASTIC_RDZV_CONF` and ``is_host`` (decided here rather than by
        torch's host name heuristics)."""
        conf = {"join_timeout": timeout_s, "last_call_timeout": self.last_call_s, **ELASTIC_RDZV_CONF,
                "is_host": int(self.store_host)}
        return ",".join(f"{k}={v}" for k, v in conf.items())


@dataclass(frozen=True)
class Contract:
    """One node's view of the job. ``world_size = nnodes * nproc_per_node`` processes in all."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nproc_per_node: int
    device: str  # "cuda" or "cpu"
    rdzv_timeout: int  # seconds
    elastic: Optional[Elastic] = None  # NNODES=MIN:MAX; nnodes is then MAX

    @property
    def world_size(self) -> int:
        """Processes in all (an elastic job's largest: its world size is decided at each rendezvous round)."""
        return self.nnodes * self.nproc_per_node

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def _uint(env: Mapping[str, str], name: str, default: int, problems: list[str], lo: int = 0,
          hi: Optional[int] = None, rule: str = "") -> int:
    raw = env.get(name, "")
    raw = raw if raw != "" else str(default)
    if not _UINT.match(raw) or int(raw) < lo or (hi is not None and int(raw) > hi):
        problems.append(f"{name}={raw}: {rule or f'must be a whole number >= {lo}'}")
        return default
    return int(raw)


def resolve(host: str) -> list[str]:
    """Addresses ``host`` resolves to on this node (IPv4 first). Raises OSError when it does not resolve, also for
    a text that is no host name at all (an empty label as in ``a..b``, or one over 63 characters)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except UnicodeError:  # the IDNA encoding of the name failed: socket raises this instead of an OSError
        raise socket.gaierror(socket.EAI_NONAME, "not a valid host name: a dot-separated part is empty or longer "
                              "than 63 characters") from None
    addrs = [i[4][0] for i in infos]
    return sorted(set(addrs), key=lambda a: (":" in a, addrs.index(a)))


def is_local_address(addr: str) -> bool:
    """True when ``addr`` is assigned to an interface of this host (binding to it succeeds)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
            return True
        except OSError:
            return False


def read_contract(env: Mapping[str, str], gpus: int = 0) -> Contract:
    """Validate the launch environment of one node.

    Args:
        env: the environment (``os.environ``).
        gpus: GPUs visible on this node (the launcher counts them with ``nvidia-smi -L``).

    Raises:
        ContractError: listing every problem: NODE_RANK outside [0, NNODES), a port outside 1-65535,
            NNODES > 1 with a MASTER_ADDR that is loopback (or resolves to it) or does not resolve,
            node rank 0 on a host that does not own MASTER_ADDR, another rank on the host that does; NNODES=1 with
            several processes and a MASTER_ADDR that is not this host.
    """
    p: list[str] = []
    raw_nnodes = env.get("NNODES", "")
    if ":" in raw_nnodes:
        return _read_elastic(env, gpus, raw_nnodes, p)
    nnodes = _uint(env, "NNODES", 1, p, lo=1)
    node_rank = _uint(env, "NODE_RANK", 0, p)
    if node_rank >= nnodes and not any(x.startswith("NODE_RANK=") for x in p):
        p.append(f"NODE_RANK={node_rank}: must be in [0, NNODES={nnodes}); give each node its own rank 0..{nnodes - 1}")
    port, timeout, nproc = _common(env, gpus, p)
    master = env.get("MASTER_ADDR") or "localhost"
    if nnodes > 1:
        p += _check_master(master, node_rank, nnodes)
    elif nproc > 1:  # torchrun's processes meet at MASTER_ADDR: on one node it must be this host
        p += _check_local_master(master)
    if p:
        raise ContractError(p)
    return Contract(nnodes, node_rank, master, port, nproc, "cuda" if gpus > 0 else "cpu", timeout)


def _common(env: Mapping[str, str], gpus: int, p: list[str]) -> tuple[int, int, int]:
    """MASTER_PORT, RDZV_TIMEOUT and processes per node (static and elastic jobs alike)."""
    port = _uint(env, "MASTER_PORT", DEFAULT_MASTER_PORT, p, lo=1, hi=65535, rule="must be in 1-65535")
    timeout = _uint(env, "RDZV_TIMEOUT", DEFAULT_RDZV_TIMEOUT_S, p, lo=1, rule="must be a whole number of seconds >= 1")
    if gpus > 0:
        nproc = _uint(env, "GPUS_PER_NODE", gpus, p, lo=1, rule="processes per node: must be a whole number >= 1")
        if nproc > gpus:
            p.append(f"GPUS_PER_NODE={nproc}: only {gpus} GPU(s) are visible on this node")
    else:
        nproc = _uint(env, "NPROC_PER_NODE", 1, p, lo=1, rule="processes per node: must be a whole number >= 1")
    return port, timeout, nproc


def _read_elastic(env: Mapping[str, str], gpus: int, raw: str, p: list[str]) -> Contract:
    """``NNODES=MIN:MAX``: node ranks are given by the rendezvous (``NODE_RANK`` is not used), the host that owns
    ``MASTER_ADDR`` serves the rendezvous store."""
    lo_raw, _, hi_raw = raw.partition(":")
    if not (_UINT.match(lo_raw) and _UINT.match(hi_raw)) or int(lo_raw) < 1 or int(hi_raw) < int(lo_raw):
        p.append(f"NNODES={raw}: an elastic job needs MIN:MAX with whole numbers 1 <= MIN <= MAX (e.g. 2:3: start "
                 "with at least 2 nodes, admit up to 3)")
        lo, hi = 1, 1
    else:
        lo, hi = int(lo_raw), int(hi_raw)
    restarts = _uint(env, "MAX_RESTARTS", DEFAULT_MAX_RESTARTS, p, rule="restarts of the worker group after a "
                     "failure: must be a whole number >= 0")
    last_call = _uint(env, "RDZV_LAST_CALL_TIMEOUT", DEFAULT_LAST_CALL_S, p, rule="seconds a round waits for more "
                      "nodes once MIN have joined: must be a whole number >= 0")
    job = env.get("SLURM_JOB_ID") or env.get("PBS_JOBID") or "sft"
    rdzv_id = env.get("RDZV_ID") or re.sub(r"[^A-Za-z0-9._-]", "-", job)[:64]
    if not _RDZV_ID.match(rdzv_id):
        p.append(f"RDZV_ID={rdzv_id}: 1-64 letters, digits, '.', '_' or '-' (the same on every node of the job)")
    port, timeout, nproc = _common(env, gpus, p)
    master = env.get("MASTER_ADDR") or "localhost"
    store_host = False
    if hi > 1:
        try:
            addrs = resolve(master)
        except OSError as e:
            addrs = []
            p.append(f"MASTER_ADDR={master}: does not resolve on this node ({e.strerror or e}); give the address of "
                     "the host that serves the rendezvous store (it must stay up for the whole job)")
        if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
            p.append(f"MASTER_ADDR={master}: a loopback address with NNODES={raw}; other nodes cannot reach it. Give "
                     "the store host's address on the network the nodes share")
        store_host = any(is_local_address(a) for a in addrs)
    else:
        p += _check_local_master(master) if nproc > 1 else []
        store_host = True
    if p:
        raise ContractError(p)
    return Contract(hi, 0, master, port, nproc, "cuda" if gpus > 0 else "cpu", timeout,
                    Elastic(lo, restarts, rdzv_id, store_host, last_call))


def scheduler_nnodes(env: Mapping[str, str], allocated: int, source: str) -> str:
    """``NNODES`` for every node's launcher of a job that a scheduler gave ``allocated`` nodes, one launcher each
    (``scripts/slurm_train.sh``, ``scripts/pbs_train.sh``): ``"N"`` (a static job, also when ``NNODES`` holds a
    plain number: the allocation wins, as it always has) or ``"MIN:N"`` (an elastic job), asked for with
    ``MIN_NODES=MIN`` or ``NNODES=MIN:MAX``. The maximum is always the allocation: nodes are the scheduler's to
    give, so ``NNODES=MIN:MAX`` must name it. ``source`` says where ``allocated`` came from in messages
    (``SLURM_NNODES=3``, ``PBS_NODEFILE /path``).

    Raises:
        ContractError: one line per problem: ``MIN_NODES`` not a whole number in ``1..allocated``; ``NNODES=MIN:MAX``
            malformed or with MAX other than ``allocated``; ``MIN_NODES`` and ``NNODES=MIN:MAX`` both given with
            different minimums; ``allocated`` < 1.
    """
    p: list[str] = []
    if allocated < 1:
        raise ContractError([f"{source}: the job has {allocated} nodes; submit it with at least one"])
    raw_min, raw_nn = env.get("MIN_NODES", ""), env.get("NNODES", "")
    lo = None
    if raw_min != "":
        if not _UINT.match(raw_min) or not 1 <= int(raw_min) <= allocated:
            more = (f", or submit the job with at least {raw_min} nodes" if _UINT.match(raw_min) and int(raw_min) >
                    allocated else "")
            p.append(f"MIN_NODES={raw_min}: the fewest nodes the elastic job goes on with must be a whole number in "
                     f"1..{allocated} (this job has {allocated} node(s): {source}){more}")
        else:
            lo = int(raw_min)
    if ":" in raw_nn:
        lo_raw, _, hi_raw = raw_nn.partition(":")
        if not (_UINT.match(lo_raw) and _UINT.match(hi_raw)) or int(lo_raw) < 1 or int(hi_raw) < int(lo_raw):
            p.append(f"NNODES={raw_nn}: an elastic job needs MIN:MAX with whole numbers 1 <= MIN <= MAX; here MAX is "
                     f"the job's {allocated} node(s) ({source}): give NNODES=MIN:{allocated} or MIN_NODES=MIN")
        elif int(hi_raw) != allocated:
            p.append(f"NNODES={raw_nn}: MAX must be the job's node count, {allocated} ({source}): give "
                     f"NNODES={lo_raw}:{allocated}, or MIN_NODES={lo_raw} alone")
        elif raw_min != "" and lo is not None and lo != int(lo_raw):
            p.append(f"MIN_NODES={raw_min} and NNODES={raw_nn} ask for different minimums; set only one of them")
        else:
            lo = int(lo_raw)
    if p:
        raise ContractError(p)
    return str(allocated) if lo is None else f"{lo}:{allocated}"


def _check_master(master: str, node_rank: int, nnodes: int) -> list[str]:
    try:
        addrs = resolve(master)
    except OSError as e:
        return [f"MASTER_ADDR={master}: does not resolve on this node ({e.strerror or e}); give node rank 0's IP "
                "address or a host name every node can resolve"]
    loop = [a for a in addrs if ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if loop:
        shown = "" if master == loop[0] else f" (it resolves to {loop[0]} here)"
        return [f"MASTER_ADDR={master}: a loopback address{shown} with NNODES={nnodes}; other nodes cannot reach it. "
                "Give node rank 0's address on the network the nodes share (e.g. the first host of the job)"]
    local = any(is_local_address(a) for a in addrs)
    if node_rank == 0 and not local:
        return [f"NODE_RANK=0 on {socket.gethostname()}, but MASTER_ADDR={master} is not an address of this host: "
                "node rank 0 must run on MASTER_ADDR. "
                "Start this node with another NODE_RANK, or point MASTER_ADDR here"]
    if node_rank != 0 and local:
        return [f"NODE_RANK={node_rank}, but MASTER_ADDR={master} is this host ({socket.gethostname()}): the host "
                "of MASTER_ADDR must be node rank 0. Give this node NODE_RANK=0, or MASTER_ADDR the master's address"]
    return []


def _check_local_master(master: str) -> list[str]:
    """NNODES=1 with several processes: torchrun's processes connect to MASTER_ADDR, which must be this host
    (otherwise they retry for RDZV_TIMEOUT seconds and fail)."""
    fix = "with NNODES=1 leave MASTER_ADDR unset (localhost) or give an address of this host"
    try:
        addrs = resolve(master)
    except OSError as e:
        return [f"MASTER_ADDR={master}: does not resolve on this node ({e.strerror or e}); {fix}"]
    if not any(is_local_address(a) for a in addrs):
        return [f"MASTER_ADDR={master}: not an address of this host ({socket.gethostname()}), where all "
                f"processes run and meet at MASTER_ADDR; {fix}"]
    return []


# ----------------------------------------------------------------------------------------------------- interfaces

def _iface_ipv4(name: str) -> Optional[str]:
    SIOCGIFADDR = 0x8915  # Linux <linux/sockios.h>
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def route_source(master_addr: str, port: int) -> Optional[str]:
    """The local IPv4 address the kernel would use to reach ``master_addr`` (a UDP ``connect`` sends nothing)."""
    try:
        addr = next(a for a in resolve(master_addr) if ":" not in a)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))
            return s.getsockname()[0]
    except (OSError, StopIteration):
        return None


def interface_for(master_addr: str, port: int) -> tuple[Optional[str], Optional[str]]:
    """``(interface name, local address)`` of the route to the master, or ``(None, None)`` when unknown."""
    src = route_source(master_addr, port)
    if src is None:
        return None, None
    for _, name in socket.if_nameindex():
        if _iface_ipv4(name) == src:
            return name, src
    return None, src


def choose_interface(c: Contract, env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """Describe (and for gloo, choose) the network interface. Returns ``(description, variables to export)``.

    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set by the user are honoured as given. For gloo with
    NNODES > 1 and no ``GLOO_SOCKET_IFNAME``, the interface of the route to MASTER_ADDR is exported:
    gloo's default (the address the host name resolves to) is often loopback or a container bridge.

    Raises:
        ContractError: ``GLOO_SOCKET_IFNAME`` names an interface this node does not have.
    """
    var = "NCCL_SOCKET_IFNAME" if c.backend == "nccl" else "GLOO_SOCKET_IFNAME"
    given = env.get(var)
    if c.backend == "gloo" and given:
        missing = [n for n in given.split(",") if n not in {name for _, name in socket.if_nameindex()}]
        if missing:
            have = ", ".join(name for _, name in socket.if_nameindex())
            raise ContractError([f"GLOO_SOCKET_IFNAME={given}: no interface {', '.join(missing)} on this node "
                                 f"(it has {have})"])
    if given:
        return f"{given} ({var})", {}
    if c.nnodes == 1:
        return "local", {}
    name, src = interface_for(c.master_addr, c.master_port)
    if name is None:
        return f"unknown (no route to {c.master_addr} found; set {var})", {}
    if c.backend == "gloo":
        return f"{name} {src} (route to master; GLOO_SOCKET_IFNAME={name})", {"GLOO_SOCKET_IFNAME": name}
    return f"{name} {src} (route to master; NCCL chooses its own unless NCCL_SOCKET_IFNAME is set)", {}


def start_line(c: Contract, iface: str) -> str:
    """The one line each node prints at start."""
    if c.elastic is not None:
        e = c.elastic
        role = "serves the rendezvous store" if e.store_host else "joins the rendezvous store"
        return (f"launch: elastic job {e.rdzv_id}: {e.min_nodes} to {c.nnodes} nodes (node ranks given by the "
                f"rendezvous), {c.nproc_per_node} process(es) per node, up to {e.max_restarts} restart(s); this node "
                f"{role} at {c.master_addr}:{c.master_port}, interface {iface}, backend {c.backend} "
                f"(device {c.device})")
    return (f"launch: node rank {c.node_rank} of {c.nnodes} nodes, {c.nproc_per_node} process(es) per node, "
            f"world size {c.world_size}, master {c.master_addr}:{c.master_port}, interface {iface}, "
            f"backend {c.backend} (device {c.device})")


