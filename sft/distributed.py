"""Multi-node runs: the launcher's environment contract, preflight checks, bounded waits.

One implementation for the shell launcher (``finetune/launch.sh`` calls the CLI below) and for the
training processes (``sft.arguments`` / ``sft.training`` call the functions):

* :func:`read_contract` -- ``NNODES`` (1), ``NODE_RANK`` (0), ``MASTER_ADDR`` (localhost),
  ``MASTER_PORT`` (6001), ``GPUS_PER_NODE`` (every visible GPU) or, without GPUs,
  ``NPROC_PER_NODE`` (1), ``RDZV_TIMEOUT`` (600 s). Every broken rule is reported at once.
* :func:`node_rendezvous` -- before torchrun: node rank 0 checks that ``MASTER_PORT`` is free and
  collects one hello per node on it; every other node waits (up to ``RDZV_TIMEOUT``) for the master to
  accept connections. Missing nodes, two nodes with one ``NODE_RANK`` and nodes that disagree on
  ``NNODES`` are reported by name on every node that got that far. The socket is closed before torchrun
  binds the same port for its own (static, TCPStore) rendezvous.
* :func:`init_process_group` -- on CPU, transformers 5.24 / accelerate 1.15 call
  ``torch.distributed.init_process_group`` for gloo without ``timeout`` (so gloo waits 30 minutes);
  we initialise it first, with ``--ddp_timeout``.
* :func:`check_same_inputs` -- after the process group is up and before the model loads, every rank
  compares the sha256 of the data file(s), of the model's ``config.json``, of its tokenizer files, the
  package version and its view of the world size; a mismatch names the nodes that differ.
* :func:`explain_collective_failure` -- turns torch's "connection closed by peer [addr]" / timeout
  errors into a message naming the node rank and host that went away.

CLI (stdlib only, so the launcher does not pay for importing torch)::

    python -m sft.distributed plan --gpus N   # validate, print the node's start line (stderr) and shell assignments (stdout)
    python -m sft.distributed rendezvous      # the node rendezvous above, from the (validated) environment

Both exit 2 with ``error: ...`` on stderr when the user has something to fix.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shlex
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from .data import file_sha256
from .errors import SFTError

DEFAULT_MASTER_PORT = 6001
DEFAULT_RDZV_TIMEOUT_S = 600  # torch's static rendezvous default is 600 s too
PEER_LOST_EXIT_CODE = 1

_UINT = re.compile(r"^(0|[1-9][0-9]{0,8})$")  # decimal, no leading zeros, no overflow


class ContractError(SFTError):
    """The node/process environment (NNODES, NODE_RANK, MASTER_ADDR, ...) is invalid. Lists every problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n  ".join(problems) if len(problems) == 1 else
                         f"invalid launch environment ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems))


class PreflightError(SFTError):
    """A multi-node preflight check failed (unreachable master, missing node, duplicate rank, different inputs)."""


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

    @property
    def world_size(self) -> int:
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
    """Addresses ``host`` resolves to on this node (IPv4 first). Raises OSError when it does not resolve."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
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
            node rank 0 on a host that does not own MASTER_ADDR, another rank on the host that does.
    """
    p: list[str] = []
    nnodes = _uint(env, "NNODES", 1, p, lo=1)
    node_rank = _uint(env, "NODE_RANK", 0, p)
    if node_rank >= nnodes and not any(x.startswith("NODE_RANK=") for x in p):
        p.append(f"NODE_RANK={node_rank}: must be in [0, NNODES={nnodes}); give each node its own rank 0..{nnodes - 1}")
    port = _uint(env, "MASTER_PORT", DEFAULT_MASTER_PORT, p, lo=1, hi=65535, rule="must be in 1-65535")
    timeout = _uint(env, "RDZV_TIMEOUT", DEFAULT_RDZV_TIMEOUT_S, p, lo=1, rule="must be a whole number of seconds >= 1")
    if gpus > 0:
        nproc = _uint(env, "GPUS_PER_NODE", gpus, p, lo=1, rule="processes per node: must be a whole number >= 1")
        if nproc > gpus:
            p.append(f"GPUS_PER_NODE={nproc}: only {gpus} GPU(s) are visible on this node")
    else:
        nproc = _uint(env, "NPROC_PER_NODE", 1, p, lo=1, rule="processes per node: must be a whole number >= 1")
    master = env.get("MASTER_ADDR") or "localhost"
    if nnodes > 1:
        p += _check_master(master, node_rank, nnodes)
    if p:
        raise ContractError(p)
    return Contract(nnodes, node_rank, master, port, nproc, "cuda" if gpus > 0 else "cpu", timeout)


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
                "node rank 0 must run on MASTER_ADDR. Start this node with another NODE_RANK, or point MASTER_ADDR here"]
    if node_rank != 0 and local:
        return [f"NODE_RANK={node_rank}, but MASTER_ADDR={master} is this host ({socket.gethostname()}): the host "
                "of MASTER_ADDR must be node rank 0. Give this node NODE_RANK=0, or MASTER_ADDR the master's address"]
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
    return (f"launch: node rank {c.node_rank} of {c.nnodes} nodes, {c.nproc_per_node} process(es) per node, "
            f"world size {c.world_size}, master {c.master_addr}:{c.master_port}, interface {iface}, "
            f"backend {c.backend} (device {c.device})")


# ---------------------------------------------------------------------------------------------- node rendezvous

def _hello(c: Contract) -> dict:
    from . import __version__

    return {"node_rank": c.node_rank, "nnodes": c.nnodes, "nproc_per_node": c.nproc_per_node,
            "host": socket.gethostname(), "version": __version__}


def _send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.sendall((json.dumps(obj) + "\n").encode())
    except OSError:
        pass  # that node went away; the others still get their answer


def _recv_line(conn: socket.socket, deadline: float) -> Optional[dict]:
    buf = b""
    while b"\n" not in buf:
        conn.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = conn.recv(4096)
        except (socket.timeout, OSError):
            return None
        if not chunk:
            return None
        buf += chunk
        if len(buf) > 65536:
            return None
    try:
        obj = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _bind_master_port(c: Contract) -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # torchrun rebinds right after us
    try:
        srv.bind(("", c.master_port))
    except OSError as e:
        srv.close()
        raise PreflightError(f"MASTER_PORT={c.master_port} is already in use on this node ({e.strerror}): another job "
                             "or an earlier run that is still exiting holds it; choose another MASTER_PORT (the same "
                             "on every node) or stop that process") from None
    srv.listen(max(16, c.nnodes))
    return srv


def _master_rendezvous(c: Contract, srv: socket.socket, log) -> None:
    """Node rank 0: accept one hello per other node until all NNODES ranks are present or the timeout passes."""
    me = _hello(c)
    nodes = {0: me}
    conns: list[tuple[socket.socket, dict]] = []
    problems: list[str] = []
    deadline = time.monotonic() + c.rdzv_timeout
    try:
        while len(nodes) < c.nnodes and not problems and time.monotonic() < deadline:
            srv.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
            try:
                conn, peer = srv.accept()
            except socket.timeout:
                continue
            hello = _recv_line(conn, time.monotonic() + 10)
            if hello is None or "node_rank" not in hello:
                log(f"rendezvous: ignored a connection from {peer[0]} that did not speak this preflight")
                conn.close()
                continue
            hello["addr"] = peer[0]
            conns.append((conn, hello))
            problems += _hello_problems(me, nodes, hello)
            if not problems:
                nodes[hello["node_rank"]] = hello
                log(f"rendezvous: node rank {hello['node_rank']} ({hello['host']}, {peer[0]}) joined; "
                    f"{len(nodes)} of {c.nnodes} nodes")
        if not problems and len(nodes) < c.nnodes:
            problems.append(_missing_message(c, nodes))
        verdict = {"error": "\n".join(problems)} if problems else {"ok": True}
        for conn, _ in conns:
            _send(conn, verdict)
    finally:
        srv.close()  # closed before the answers' sockets: once a node sees EOF, the port is free for torchrun
        for conn, _ in conns:
            conn.close()
    if problems:
        raise PreflightError("\n".join(problems))


def _who(n: dict) -> str:
    return f"node rank {n['node_rank']} ({n['host']}{', ' + n['addr'] if n.get('addr') else ''})"


def _hello_problems(me: dict, nodes: dict, hello: dict) -> list[str]:
    r = hello["node_rank"]
    if r in nodes:
        first = nodes[r]
        return [f"two nodes were started with NODE_RANK={r}: {first['host']}{' (' + first['addr'] + ')' if first.get('addr') else ''} "
                f"and {hello['host']} ({hello['addr']}); give every node its own NODE_RANK in 0..{me['nnodes'] - 1}"]
    p = []
    if hello.get("nnodes") != me["nnodes"]:
        p.append(f"{_who(hello)} was started with NNODES={hello.get('nnodes')}, node rank 0 with NNODES={me['nnodes']}; "
                 "give every node the same NNODES")
    if hello.get("nproc_per_node") != me["nproc_per_node"]:
        p.append(f"{_who(hello)} runs {hello.get('nproc_per_node')} process(es), node rank 0 runs {me['nproc_per_node']}; "
                 "give every node the same GPUS_PER_NODE / NPROC_PER_NODE")
    if hello.get("version") != me["version"]:
        p.append(f"{_who(hello)} runs sft {hello.get('version')}, node rank 0 runs {me['version']}; install the same "
                 "version on every node")
    return p


def _missing_message(c: Contract, nodes: dict) -> str:
    missing = [str(r) for r in range(c.nnodes) if r not in nodes]
    joined = ", ".join(f"{r} ({n['host']})" for r, n in sorted(nodes.items()))
    return (f"only {len(nodes)} of {c.nnodes} nodes joined within RDZV_TIMEOUT={c.rdzv_timeout} s (joined: node ranks "
            f"{joined}; missing: node rank{'s' if len(missing) > 1 else ''} {', '.join(missing)}). Start the missing "
            f"node(s) with MASTER_ADDR={c.master_addr} MASTER_PORT={c.master_port}, or look at their logs for why "
            "they stopped")


def _worker_rendezvous(c: Contract, log) -> None:
    """Node rank > 0: connect to the master (retrying until RDZV_TIMEOUT), say hello, wait for the verdict."""
    deadline = time.monotonic() + c.rdzv_timeout
    last = "no attempt"
    addrs = [a for a in resolve(c.master_addr) if ":" not in a] or resolve(c.master_addr)
    conn = None
    while conn is None:
        try:
            conn = socket.create_connection((addrs[0], c.master_port), timeout=max(0.1, min(3.0, deadline - time.monotonic())))
        except OSError as e:
            last = e.strerror or ("no answer (connection timed out)" if isinstance(e, TimeoutError) else type(e).__name__)
            if time.monotonic() >= deadline:
                raise PreflightError(
                    f"node rank {c.node_rank}: cannot reach the master at {c.master_addr}:{c.master_port} within "
                    f"RDZV_TIMEOUT={c.rdzv_timeout} s (last error: {last}). Check that MASTER_ADDR is node rank 0's "
                    "address as seen from this node, that node rank 0 was started (with the same MASTER_PORT), and "
                    "that no firewall blocks the port") from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    with conn:
        _send(conn, _hello(c))
        log(f"rendezvous: connected to the master {c.master_addr}:{c.master_port}; waiting for all {c.nnodes} nodes")
        verdict = _recv_line(conn, time.monotonic() + c.rdzv_timeout + 30)
        if verdict is None:
            raise PreflightError(f"node rank {c.node_rank}: the master at {c.master_addr}:{c.master_port} closed the "
                                 "connection without an answer (it failed, or another program listens on MASTER_PORT); "
                                 "see node rank 0's log")
        if "error" in verdict:
            raise PreflightError(str(verdict["error"]))
        conn.settimeout(30)
        try:  # the master closes its listening socket before this one: after EOF, torchrun can bind the port
            while conn.recv(4096):
                pass
        except OSError:
            pass


def node_rendezvous(c: Contract, log=lambda m: print(m, file=sys.stderr, flush=True)) -> None:
    """The preflight before torchrun (see the module docstring). Single node: only the port check.

    Raises:
        PreflightError: port in use; master unreachable within the timeout; a node missing, started twice
            with one NODE_RANK, or with a different NNODES / processes per node / version.
    """
    if c.node_rank == 0:
        srv = _bind_master_port(c)
        if c.nnodes == 1:
            srv.close()
            return
        _master_rendezvous(c, srv, log)
    else:
        _worker_rendezvous(c, log)


# ----------------------------------------------------------------------------------- inside the training processes

def preflight_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """False when the user opted out (``SFT_PREFLIGHT=0``, set by the launcher's ``--no_preflight``)."""
    return env.get("SFT_PREFLIGHT", "1").strip().lower() not in ("0", "false", "no", "off")


def init_process_group(backend: Optional[str], timeout_s: float) -> bool:
    """Initialise torch.distributed from torchrun's environment with a bounded timeout, on CPU only.

    transformers 5.24 ``TrainingArguments._setup_devices`` passes ``timeout=ddp_timeout`` to accelerate for
    GPUs but not for ``use_cpu`` runs, and accelerate 1.15 ``PartialState`` (MULTI_CPU branch) then calls
    ``init_process_group`` without it: a lost peer would block gloo for torch's 30-minute default. Calling
    this first makes accelerate reuse our group. Returns True when it initialised the group.
    """
    import datetime

    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.cuda.is_available():
        return False
    if not all(k in os.environ for k in ("RANK", "MASTER_ADDR", "MASTER_PORT")):
        return False  # not torchrun's env:// (e.g. an MPI launch): leave it to accelerate
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    dist.init_process_group(backend=backend or "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "qwen.tiktoken", "chat_template.jinja",
                   "chat_template.json")


def _model_file(model: str, name: str) -> Optional[str]:
    if os.path.isdir(model):
        path = os.path.join(model, name)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, name)
        return found if isinstance(found, str) else None
    except ImportError:
        return None


def input_fingerprint(model_path: str, data_files: dict[str, str]) -> dict:
    """What must be identical on every rank: ``{"<flag> file": sha256, "model config (config.json)": sha256,
    "tokenizer files": sha256, "sft version": str, "world view": str}`` (hex digests of file bytes).

    ``data_files`` maps a flag (``--data_path``) to the file it names on this node; the contents are compared,
    not the paths."""
    from . import __version__

    fp = {f"{flag} file": file_sha256(path) for flag, path in data_files.items()}
    cfg = _model_file(model_path, "config.json")
    fp["model config (config.json)"] = file_sha256(cfg) if cfg else "missing"
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = _model_file(model_path, name)
        if path:
            h.update(name.encode() + b"\0" + file_sha256(path).encode())
    fp["tokenizer files"] = h.hexdigest()
    fp["sft version"] = __version__
    fp["world view"] = (f"world size {os.environ.get('WORLD_SIZE')}, {os.environ.get('GROUP_WORLD_SIZE', '?')} nodes, "
                        f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} per node")
    return fp


_PEERS: dict[str, dict] = {}  # address -> {"node_rank", "host", "ranks"}, filled by check_same_inputs


def _rank_info() -> dict:
    node_rank = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))  # torchrun sets GROUP_RANK, Ray Train NODE_RANK
    return {"rank": int(os.environ.get("RANK", "0")), "node_rank": int(node_rank),
            "host": socket.gethostname(),
            "addr": route_source(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "1")))}


def compare_fingerprints(infos: list[dict]) -> list[str]:
    """One line per fingerprint item on which ranks disagree, naming the node ranks/hosts on each side.

    ``infos``: one ``{"rank", "node_rank", "host", "fp": {item: value}}`` per rank, in rank order, optionally
    with ``"where": {item: text}`` shown next to a value (the file's path on that node). The value of global
    rank 0 is the reference.
    """
    problems = []
    for item in infos[0]["fp"]:
        groups: dict[str, list[dict]] = {}
        for info in infos:
            groups.setdefault(str(info["fp"].get(item, "missing")), []).append(info)
        if len(groups) == 1:
            continue
        ref = str(infos[0]["fp"].get(item, "missing"))
        sides = []
        for value, members in sorted(groups.items(), key=lambda kv: kv[0] != ref):
            nodes = sorted({(m["node_rank"], m["host"]) for m in members})
            who = ", ".join(f"node rank {n} ({h})" for n, h in nodes)
            shown = value[:12] + "..." if re.fullmatch(r"[0-9a-f]{64}", value) else value
            where = sorted({m.get("where", {}).get(item) for m in members} - {None})
            shown += f" ({', '.join(where)})" if where else ""
            sides.append(f"{who}: {shown}")
        problems.append(f"{item} differs between nodes: " + "; ".join(sides))
    for info in infos:
        for item in info["fp"]:
            if item not in infos[0]["fp"]:
                problems.append(f"{item}: only on node rank {info['node_rank']} ({info['host']})")
    return problems


def check_same_inputs(model_path: str, data_files: dict[str, Optional[str]]) -> None:
    """All ranks: gather every rank's :func:`input_fingerprint` and fail together when any item differs.

    Needs an initialised default process group; a no-op for one process or with ``SFT_PREFLIGHT=0``.

    Raises:
        PreflightError: naming each differing item and the node ranks / hosts holding each version.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    files = {flag: path for flag, path in data_files.items() if path}
    mine = {**_rank_info(), "fp": input_fingerprint(model_path, files), "where": {f"{f} file": p for f, p in files.items()}}
    infos: list = [None] * dist.get_world_size()
    dist.all_gather_object(infos, mine)
    for info in infos:
        peer = _PEERS.setdefault(info["addr"] or "?", {"node_rank": info["node_rank"], "host": info["host"], "ranks": []})
        peer["ranks"].append(info["rank"])
    problems = compare_fingerprints(infos)
    if problems:
        raise PreflightError("the nodes do not train on the same inputs:\n" + "\n".join(f"  - {p}" for p in problems)
                             + "\nCopy the same files to every node (or keep them on a shared filesystem), then start "
                             "again; SFT_PREFLIGHT=0 skips this check")


# gloo names the peer as "[ip]:port" ("Connection closed by peer [10.0.0.3]:4123", "Read error [10.0.0.3]:4123:
# Connection reset by peer"); the first bracketed address is the peer (source paths in brackets start with "/").
_PEER_ADDR = re.compile(r"\[(\d{1,3}(?:\.\d{1,3}){3}|[0-9a-fA-F:]*:[0-9a-fA-F:]+)\]:(\d+)")


def explain_collective_failure(err: BaseException, timeout_s: Optional[float] = None) -> Optional[str]:
    """A user message for a torch.distributed failure during training, or None when ``err`` is not one.

    Recognises torch's gloo/NCCL messages that a peer closed its connection (the address is mapped to the
    node rank and host recorded by :func:`check_same_inputs`) or that a collective timed out.
    """
    text = str(err)
    first = text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__
    lowered = text.lower()
    dist_types = tuple(t for t in (getattr(__import__("torch").distributed, "DistError", None),) if t)
    if not (isinstance(err, dist_types) or "gloo" in lowered or "nccl" in lowered or "connection closed" in lowered):
        return None
    m = _PEER_ADDR.search(text)
    who = ""
    if m:
        peer = _PEERS.get(m.group(1))
        who = (f"the peer at {m.group(1)} is node rank {peer['node_rank']} ({peer['host']}, global rank(s) "
               f"{', '.join(map(str, peer['ranks']))}); " if peer else f"the peer was {m.group(1)}; ")
    if "timed out" in lowered or "timeout" in lowered:
        cause = f"a collective got no answer within --ddp_timeout {timeout_s:g} s" if timeout_s else "a collective timed out"
    else:
        cause = "another process of the job went away"
    return (f"training stopped: {cause}; {who}torch reports: {first}\nLook at the other nodes' logs for the first "
            "error (a crash, out of memory, a killed or preempted node); --ddp_timeout sets how long a lost node "
            "is waited for")


# --------------------------------------------------------------------------------------------------------- CLI

def _cli_plan(args) -> int:
    c = read_contract(os.environ, args.gpus)
    iface, exports = choose_interface(c, os.environ)
    print(start_line(c, iface), file=sys.stderr, flush=True)
    values = {"NNODES": c.nnodes, "NODE_RANK": c.node_rank, "MASTER_ADDR": c.master_addr,
              "MASTER_PORT": c.master_port, "NPROC": c.nproc_per_node, "DEVICE": c.device,
              "RDZV_TIMEOUT": c.rdzv_timeout, "WORLD": c.world_size}
    for k, v in values.items():
        print(f"{k}={shlex.quote(str(v))}")
    for k, v in exports.items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


def _cli_rendezvous(args) -> int:
    c = read_contract(os.environ, args.gpus)
    node_rendezvous(c)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sft.distributed", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn, text in (("plan", _cli_plan, "validate the environment, print the start line and shell assignments"),
                           ("rendezvous", _cli_rendezvous, "the preflight node rendezvous before torchrun")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--gpus", type=int, default=0, help="GPUs visible on this node")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except SFTError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
