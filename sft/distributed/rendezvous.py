"""The preflight node rendezvous before torchrun (stdlib only; see :func:`node_rendezvous`).

Node rank 0 checks that ``MASTER_PORT`` is free and collects one hello per node on it; every other node
waits (up to ``RDZV_TIMEOUT``) for the master to accept connections. Missing nodes, two nodes with one
``NODE_RANK`` and nodes that disagree on ``NNODES``, processes per node or the package version are reported
by name on every node that got that far. The socket is closed before torchrun binds the same port for its
own (static, TCPStore) rendezvous.

Protocol: one JSON object per line over TCP. A node sends ``{"node_rank", "nnodes", "nproc_per_node",
"host", "version"}``; the master answers ``{"ok": true}`` or ``{"error": "..."}`` to every node once all
have joined (or the timeout passed), then closes.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Mapping, Optional

from sft import __version__
from sft.distributed.contract import Contract, resolve
from sft.errors import PreflightError


def preflight_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """False when the user opted out (``SFT_PREFLIGHT=0``, set by the launcher's ``--no_preflight``)."""
    return env.get("SFT_PREFLIGHT", "1").strip().lower() not in ("0", "false", "no", "off")


def _hello(c: Contract) -> dict:
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
        return [f"two nodes were started with NODE_RANK={r}: "
                f"{first['host']}{' (' + first['addr'] + ')' if first.get('addr') else ''} "
                f"and {hello['host']} ({hello['addr']}); give every node its own NODE_RANK in 0..{me['nnodes'] - 1}"]
    p = []
    if hello.get("nnodes") != me["nnodes"]:
        p.append(f"{_who(hello)} was started with NNODES={hello.get('nnodes')}, "
                 f"node rank 0 with NNODES={me['nnodes']}; give every node the same NNODES")
    if hello.get("nproc_per_node") != me["nproc_per_node"]:
        p.append(f"{_who(hello)} runs {hello.get('nproc_per_node')} process(es), "
                 f"node rank 0 runs {me['nproc_per_node']}; give every node the same GPUS_PER_NODE / NPROC_PER_NODE")
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


def _connect(c: Contract, deadline: float, unreachable, waiting=None) -> socket.socket:
    """A connection to MASTER_ADDR:MASTER_PORT, retried every 0.5 s until ``deadline`` (``time.monotonic()``).

    Raises:
        PreflightError: ``unreachable(last error)`` when no attempt succeeded in time. ``waiting()`` is called
            once, after the first failed attempt."""
    addrs = [a for a in resolve(c.master_addr) if ":" not in a] or resolve(c.master_addr)
    last, said = "no attempt", False
    while True:
        try:
            return socket.create_connection((addrs[0], c.master_port),
                                            timeout=max(0.1, min(3.0, deadline - time.monotonic())))
        except OSError as e:
            last = e.strerror or ("no answer (connection timed out)" if isinstance(e, TimeoutError)
                                  else type(e).__name__)
        if time.monotonic() >= deadline:
            raise PreflightError(unreachable(last)) from None
        if waiting is not None and not said:
            waiting()
            said = True
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _worker_rendezvous(c: Contract, log) -> None:
    """Node rank > 0: connect to the master (retrying until RDZV_TIMEOUT), say hello, wait for the verdict."""
    conn = _connect(c, time.monotonic() + c.rdzv_timeout, lambda last: (
        f"node rank {c.node_rank}: cannot reach the master at {c.master_addr}:{c.master_port} within "
        f"RDZV_TIMEOUT={c.rdzv_timeout} s (last error: {last}). Check that MASTER_ADDR is node rank 0's "
        "address as seen from this node, that node rank 0 was started (with the same MASTER_PORT), and "
        "that no firewall blocks the port"))
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


def _wait_for_store(c: Contract, log) -> None:
    """Elastic job, a node that does not serve the store: wait (up to RDZV_TIMEOUT) until the store host's
    launcher accepts connections on MASTER_PORT. The probe connects and closes without a word: the c10d store
    drops such a connection."""
    _connect(c, time.monotonic() + c.rdzv_timeout, lambda last: (
        f"this node cannot reach the elastic job's rendezvous store at {c.master_addr}:{c.master_port} within "
        f"RDZV_TIMEOUT={c.rdzv_timeout} s (last error: {last}). The store is served by the launcher on the host "
        "that owns MASTER_ADDR: start it there (same MASTER_PORT and NNODES), check that MASTER_ADDR is that "
        "host's address as seen from here and that no firewall blocks the port"),
        lambda: log(f"rendezvous: waiting for the rendezvous store at {c.master_addr}:{c.master_port} (up to "
                    f"RDZV_TIMEOUT={c.rdzv_timeout} s)")).close()


def node_rendezvous(c: Contract, log=lambda m: print(m, file=sys.stderr, flush=True)) -> None:
    """The preflight before torchrun (see the module docstring). Single node: only the port check. An elastic
    job (``NNODES=MIN:MAX``, whose nodes come and go): the store host checks that MASTER_PORT is free, every
    other node waits until the store accepts connections; how many nodes join is torchrun's c10d rendezvous'
    to decide (at least MIN within RDZV_TIMEOUT, never more than MAX).

    Raises:
        PreflightError: port in use; master unreachable within the timeout; a node missing, started twice
            with one NODE_RANK, or with a different NNODES / processes per node / version; for an elastic job,
            the store unreachable within the timeout.
    """
    if c.elastic is not None:
        if c.elastic.store_host:
            _bind_master_port(c).close()
        else:
            _wait_for_store(c, log)
        return
    if c.node_rank == 0:
        srv = _bind_master_port(c)
        if c.nnodes == 1:
            srv.close()
            return
        _master_rendezvous(c, srv, log)
    else:
        _worker_rendezvous(c, log)
