"""torchrun (``torch.distributed.run``) as ``finetune/launch.sh`` starts it, with quiet ends on a signal or a \
failed worker.

``python -m sft.distributed.torchrun ARGS`` is ``python -m torch.distributed.run ARGS`` except for what two
outcomes print:

- A signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT: a preemption, a scheduler's stop): torchrun's agent stops its
  workers exactly as before (it passes the signal on and waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds,
  during which sft's workers save a checkpoint), but instead of logging "Received 15 death signal" and a
  Python traceback of its ``SignalException`` per node, this exits quietly with 128 + the signal number
  (143 for SIGTERM), the code a shell gives a process ended by that signal; the launcher turns it into 75
  when a worker saved a checkpoint. Further signals during that shutdown are ignored (they no longer cut the
  wait for the workers' checkpoint short or print a logging traceback).
- A failed worker (torchrun's ``ChildFailedError``, e.g. a rank that stopped because a peer node died):
  instead of torchrun's traceback and its "finetune.py FAILED" report, one line on stderr,
  ``torchrun: global rank R (local rank L on this node, pid P) exited with code C; ...`` naming where the
  worker's own output is, and the exit code is the worker's (128 + the signal number for a worker ended by
  a signal), so a scheduler sees the worker's code.

- The exit barrier broken off (torch 2.13's agent logs "Error waiting on exit barrier" with a traceback when
  the rendezvous store, served by the master node's launcher, closed while this node's launcher still waited
  on it at the end of a run: a race at every multi-node end): one line instead, saying that this node's
  workers had finished, so their result stands.

- An elastic job (``--nnodes MIN:MAX``, the c10d rendezvous): every rendezvous round and every restart of
  the worker group is one line on every node (``torchrun: rendezvous round N: this node is node rank R of W
  nodes``; ``torchrun: restart K of M: ...`` with its reason), where torch logs them at INFO, which its
  default level hides. A rendezvous that gathers fewer than MIN nodes within its join timeout is one line
  with the fix instead of torchrun's traceback.

- A worker of this node that stopped answering (SIGSTOP, a frozen process): sft's progress watchers in the
  other workers name it and write its host and pid to the job's store (:data:`sft.distributed.watchdog.
  VERDICT_KEY`); this launcher's guard thread (:class:`WorkerGuard`, static rendezvous: ``--master_addr``)
  ends it with SIGKILL, which a stopped process cannot ignore (torchrun would send SIGTERM and wait
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), and when the store itself stops answering for
  :data:`STORE_GONE_S` seconds (the master node's launcher ended: the job is over) it ends every worker of this
  node, so that no stopped worker outlives the job.

Every other outcome (success, a bad flag) is torchrun's own, unchanged.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Optional

from sft.errors import PEER_LOST_EXIT_CODE, report_exit_code

# torch 2.13: the agent logs its "Received N death signal, shutting down workers" on this logger, then
# re-raises SignalException (torch.distributed.elastic.multiprocessing.api) out of torchrun's main().
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
# ... and the process handler logs "failed (exitcode: C) local_rank: L (pid: P) of binary: ..." on this one
# before the agent raises ChildFailedError: the line below says the same with the global rank.
_PROCS_LOGGER = "torch.distributed.elastic.multiprocessing.api"


_RDZV_LOGGER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_JOINED = re.compile(r"The node '.*' has joined round (\d+) of the rendezvous '(.*)' as rank (\d+) in a world of "
                     r"size (\d+)")
_RESTARTS = {"done": 0}  # restarts seen by this launcher (the agent's own count is not public)


def _agent_lines(record: logging.LogRecord) -> bool:
    """The agent's logger at INFO, of which only the restart decisions pass, rewritten as one line each; its
    warnings stay hidden as before (torchrun's closing-signal notes), its errors pass."""
    msg = str(record.msg)
    if "will restart worker group" in msg and record.levelno == logging.INFO:
        args = record.args if isinstance(record.args, tuple) else ()
        if msg.startswith("[%s] Worker group") and len(args) == 4:
            _RESTARTS["done"] += 1
            record.msg = ("torchrun: restart %d of %d: the worker group %s (a worker here or on another node "
                          "failed, or a node was lost: the first error is above); the nodes still there meet "
                          "again, and the workers resume from the newest verified checkpoint")
            record.args = (args[3] - args[2] + 1, args[3], args[1])
        elif "new nodes" in msg and len(args) == 3:
            record.msg = ("torchrun: %s node(s) waiting to join; the worker group restarts to admit them (not "
                          "counted as a restart) and resumes from the newest verified checkpoint")
            record.args = (args[1],)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True
    return record.levelno >= logging.ERROR


def _rendezvous_lines(record: logging.LogRecord) -> bool:
    """The c10d rendezvous' logger at INFO: only "has joined round ..." passes, as one line."""
    m = _JOINED.match(str(record.msg))
    if m and record.levelno == logging.INFO:
        rnd, run_id, rank, world = m.groups()
        record.msg = "torchrun: rendezvous %s round %s: this node is node rank %s of %s nodes"
        record.args = (run_id, rnd, rank, world)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True
    return record.levelno >= logging.WARNING


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _shutdown_uninterrupted(record: logging.LogRecord) -> bool:
    """On the agent's "Received N death signal, shutting down workers" (logged right before its ``_shutdown``):
    further stop signals are ignored from here on. torch's handler raises ``SignalException`` on every signal,
    so a second one (``srun`` forcing a step's end sends SIGCONT+SIGTERM again; a second Ctrl-C) broke off the
    shutdown: mid-write in a log record it printed logging's "--- Logging error ---" traceback (seen in a real
    SLURM node-loss job log), mid-wait it left without waiting ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` for the
    workers' checkpoint. The shutdown still ends: the workers got the signal, and are SIGKILLed at the timeout."""
    if str(record.msg).startswith("Received ") and "death signal" in str(record.msg):
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
    return True


def _not_failed_report(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("failed (exitcode")


def _exit_barrier_line(record: logging.LogRecord) -> bool:
    """The agent's "Error waiting on exit barrier" record as one line, without its traceback."""
    if str(record.msg).startswith("Error waiting on exit barrier") and record.exc_info:
        err = record.exc_info[1]
        first = str(err).splitlines()[0][:200] if str(err) else ""
        record.msg = ("torchrun: the exit barrier with the other nodes' launchers broke off (%s: %s): the "
                      "rendezvous store on the master node had closed, its launcher already gone; this node's "
                      "workers had finished, so their result stands")
        record.args = (type(err).__name__, first)
        record.exc_info, record.exc_text = None, None
    return True


def _log_location(argv: list[str]) -> str:
    """Where torchrun puts a worker's output: this process's stdout/stderr unless ``--log-dir`` (with
    ``--redirects``/``--tee``) sends it to files."""
    for i, a in enumerate(argv):
        if a.split("=")[0] in ("--log-dir", "--log_dir"):
            d = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            return f"its output is under {d} (torchrun's --log-dir) and above in this log"
        if not a.startswith("-"):  # the training script: the flags after it are its own
            break
    return "its output (the first error) is above in this log: the workers write to this launcher's stdout/stderr"


def failure_line(err, argv: list[str]) -> tuple[str, int]:
    """(one line for the log, exit code) for torchrun's ``ChildFailedError`` ``err``: the first worker that
    failed (by its failure time), by global rank, local rank, pid and exit code. The code is the worker's,
    128 + N for a worker ended by signal N (torch reports those as -N)."""
    rank, failure = err.get_first_failure()
    code = int(failure.exitcode)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how, code = f"was ended by {name}", 128 - code
    else:
        how = f"exited with code {code}"
    others = len(err.failures) - 1
    more = f" ({others} other worker(s) of this node stopped after it)" if others > 0 else ""
    line = (f"torchrun: global rank {rank} (local rank {failure.local_rank} on this node, pid {failure.pid}) "
            f"{how}{more}; {_log_location(argv)}")
    return line, code




STORE_GONE_S = 30.0  # the store unanswered this long: the master node's launcher has ended (or that host froze)


def _option(argv: list, name: str) -> Optional[str]:
    """The value of ``--name V`` / ``--name=V`` in torchrun's arguments (before the training script), or None."""
    for i, a in enumerate(argv):
        if a.endswith(".py"):
            return None  # the training script: its own flags follow
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _children() -> list:
    """Pids of this process's children (torchrun's workers), from /proc."""
    from sft.distributed.watchdog import parent_pid

    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit() and parent_pid(int(name)) == me:
            out.append(int(name))
    return out


def _rank_of(pid: int) -> Optional[int]:
    """The global rank torchrun gave worker ``pid`` (``RANK`` in its environment), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except (OSError, ValueError):
        pass
    return None


class WorkerGuard(threading.Thread):
    """Ends this node's stopped workers when the job's store names them, and every worker once the store is gone
    (module docstring). ``host``/``port``: the store of a static rendezvous (``--master_addr``/``--master_port``);
    ``serves``: this launcher hosts it (node rank 0), so it is never "gone" here."""

    def __init__(self, host: str, port: int, serves: bool, interval_s: float = 2.0, gone_s: float = STORE_GONE_S):
        super().__init__(name="sft-worker-guard", daemon=True)
        self.host, self.port, self.serves = host, int(port), serves
        self.interval_s, self.gone_s = interval_s, gone_s
        self.store = None
        self.ok_at: Optional[float] = None  # when the store last answered (None: not reached yet)
        self.ended: set = set()

    def poll(self, now: float) -> None:
        import datetime
        import json

        from torch.distributed import TCPStore

        from sft.distributed.watchdog import HOST, VERDICT_KEY

        try:
            if self.store is None:
                self.store = TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=max(2.0, self.interval_s)))
            named = json.loads(self.store.get(VERDICT_KEY)) if self.store.check([VERDICT_KEY]) else []
            self.ok_at = now
        except Exception:  # noqa: BLE001 -- not reachable (yet, or any more): judged below
            self.store = None
            if self.ok_at is not None and not self.serves and now - self.ok_at >= self.gone_s:
                self.end(_children(), f"the job's store at {self.host}:{self.port} has not answered for "
                                      f"{now - self.ok_at:.0f} s (the master node's launcher ended, or that host "
                                      "froze): the job is over")
                self.ok_at = now  # once per outage
            return
        ranks = {pid: _rank_of(pid) for pid in _children()}  # a rank never heard from is named by its rank only
        self.end([pid for pid, rank in ranks.items() for n in named
                  if (n.get("host") == HOST and int(n.get("pid", -1)) == pid)
                  or ("pid" not in n and n.get("rank") == rank)],
                 "sft's progress watchers named it as not responding")

    def end(self, pids: list, why: str) -> None:
        pids = [p for p in pids if p not in self.ended]
        if not pids:
            return
        report_exit_code(PEER_LOST_EXIT_CODE)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                self.ended.add(pid)
            except OSError:
                continue
        print(f"torchrun: ended worker process(es) {', '.join(map(str, pids))} of this node with SIGKILL: {why}",
              file=sys.stderr, flush=True)

    def run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self.poll(time.monotonic())


def start_worker_guard(argv: list) -> Optional[WorkerGuard]:
    """A :class:`WorkerGuard` for a static rendezvous (``--master_addr`` and ``--master_port`` given, ``--nnodes``
    without MIN:MAX); None otherwise (an elastic job: a frozen node is left out of the next round instead)."""
    host, port = _option(argv, "--master_addr"), _option(argv, "--master_port")
    if not host or not port or ":" in (_option(argv, "--nnodes") or "1") or not port.isdigit():
        return None
    guard = WorkerGuard(host, int(port), serves=(_option(argv, "--node_rank") or "0") == "0")
    guard.start()
    return guard


def main(argv: Optional[list[str]] = None) -> int:
    """Runs torchrun with ``argv`` (default ``sys.argv[1:]``); its exit code: 0, 128 + signal number when a
    signal stopped it, the first failed worker's code (one line on stderr says which); also written as
    ``torchrun CODE`` to ``SFT_EXIT_CODE_FILE`` when that is set. Raises SystemExit as torchrun does for bad
    arguments."""
    code = _run(argv)
    report_exit_code(code, "torchrun")
    return code


def _run(argv: Optional[list[str]]) -> int:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    argv = sys.argv[1:] if argv is None else argv
    logging.getLogger(_AGENT_LOGGER).setLevel(logging.INFO)
    logging.getLogger(_AGENT_LOGGER).addFilter(_shutdown_uninterrupted)  # first: a filter that says no stops the rest
    logging.getLogger(_AGENT_LOGGER).addFilter(_agent_lines)
    logging.getLogger(_AGENT_LOGGER).addFilter(_exit_barrier_line)
    logging.getLogger(_RDZV_LOGGER).setLevel(logging.INFO)
    logging.getLogger(_RDZV_LOGGER).addFilter(_rendezvous_lines)
    logging.getLogger(_PROCS_LOGGER).addFilter(_not_failed_report)
    start_worker_guard(argv)
    try:
        run.main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except RendezvousTimeoutError as e:
        print(f"torchrun: the elastic rendezvous did not gather enough nodes within its join timeout "
              f"(RDZV_TIMEOUT; {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}): fewer than the "
              "minimum of NNODES=MIN:MAX joined. Start more nodes with the same NNODES, MASTER_ADDR, MASTER_PORT "
              "and RDZV_ID, lower MIN, or look at the missing nodes' logs", file=sys.stderr, flush=True)
        return 2
    except RendezvousConnectionError as e:
        cause = e.__cause__ or e
        print(f"torchrun: cannot reach the elastic job's rendezvous store ({str(cause).splitlines()[0][:200]}): it "
              "is served by the launcher on the host of MASTER_ADDR, which has finished, stopped or was lost (a job "
              "does not survive losing that host); if the job is still running there, check MASTER_ADDR and "
              "MASTER_PORT", file=sys.stderr, flush=True)
        return 1
    except (RendezvousClosedError, AttributeError) as e:
        # torch 2.13: a node that arrives when the elastic rendezvous is closed (the job finished or failed)
        # gets RendezvousClosedError, or, when it was on the waiting list, agent.run() returns None and
        # launch_agent fails on None.is_failed()
        if isinstance(e, AttributeError) and "is_failed" not in str(e):
            raise
        print("torchrun: the elastic job's rendezvous is closed (the job has finished or stopped): this node was "
              "not admitted and ran nothing; start a new job (another RDZV_ID) to train again", file=sys.stderr,
              flush=True)
        return 1
    except ChildFailedError as e:
        # the workers are gone; a signal now (a scheduler ending the other nodes' steps after this failure)
        # must not turn the worker's code into torchrun's SignalException
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        line, code = failure_line(e, argv)
        print(line, file=sys.stderr, flush=True)
        return code if code != 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
