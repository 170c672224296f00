"""Progress beats without collectives: a stuck or frozen rank named in seconds, and what every rank was doing.

Every training process keeps one record of its progress (:data:`RECORD`): the optimizer step it works on, its
phase (loading the next batch, forward and backward, optimizer step, logging, evaluation, saving a checkpoint, data
preparation, ...), the collective or file wait it is in, when the phase began, and a progress counter that only
the training loop moves (:meth:`Record.set`, :meth:`Record.advance`). Marking a phase is a few attribute writes
on the training thread: no I/O, no lock.

Under torchrun, a watcher thread (:class:`Watcher`, started with the process group by
:func:`sft.distributed.process_group.start_runtime`) publishes that record every ``interval`` seconds to the
job's c10d TCP store -- the one torchrun already serves on ``MASTER_ADDR:MASTER_PORT`` (node rank 0's agent, or
rank 0 of an elastic round) -- over a client connection of its own, so that neither blocks the other, and reads
every rank's. It adds a liveness counter (``tick``) of its own: a process that is stopped, swapped out or holds
the GIL in a hung call stops ticking; one that waits in a collective or a syscall keeps ticking while its
progress counter stands still. Every process judges by its own monotonic clock when each rank's counters last
moved (no clock agreement between hosts is needed).

Judgment (:func:`judge`), with ``T`` = ``--hang_timeout``:

* **not responding**: progress still for ``T``, ticks for ``T / 2`` (three beats, 5 s at least) -- a frozen
  process or node, in any phase;
* **stuck**: alive, progress still for ``T`` in a phase of the training step (:data:`STEP_PHASES`) and not
  waiting in a collective -- a data loader that never returns, a deadlock; of several such ranks the ones behind
  (lowest step, then earliest phase) are named. Not while another rank's ticks have stopped: a rank waiting inside
  DDP's backward for a frozen peer stalls a moment before that peer's last progress is ``T`` old, and the frozen
  peer is named ("not responding") once it is. Phases that may legitimately run long without a beat (loading,
  data preparation, saving) are judged only by "not responding": a live rank there is bounded by
  ``--ddp_timeout`` / ``--data_timeout`` as before;
* **store lost**: the store has not answered for ``T`` -- the host of ``MASTER_ADDR`` froze or lost its network.

On a verdict every surviving process writes one line per named rank (rank, host, pid, last step and phase, how
long ago), its own Python stack (:mod:`faulthandler`, every thread: where it waits), ends a named rank of its own
agent that stopped answering (SIGKILL: a stopped process ignores SIGTERM, and torchrun would wait
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` for it), and the lowest live rank of each host one paragraph; then it exits
with :data:`sft.errors.PEER_LOST_EXIT_CODE` (``os._exit``: the training thread may be blocked in C++). An
elastic torchrun restarts the survivors from the last complete checkpoint; a frozen agent misses the next
rendezvous and its node is left out, as a dead one is. Standard library only (the store client is made by
:func:`sft.distributed.process_group.start_progress_watcher`); over 400 lines because the beat, its judgment and the
report of a hang are one protocol, read together.
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from sft.errors import PEER_LOST_EXIT_CODE, report_exit_code

# Phases of an optimizer step, in the order a step runs them (a rank's position is (step, index here)).
LOADING_BATCH, FORWARD_BACKWARD, OPTIMIZER, LOGGING, EVALUATION = (
    "loading the next batch", "forward and backward", "optimizer step", "logging", "evaluation")
STEP_PHASES = (LOADING_BATCH, FORWARD_BACKWARD, OPTIMIZER, LOGGING, EVALUATION)
SAVING = "saving a checkpoint"  # may run long without a beat, like the phases before training
FINISHED = "finished"  # a rank that left training cleanly: never named
_ORDER = {p: i for i, p in enumerate(STEP_PHASES + (SAVING,))}

KEY_PREFIX = "sft/progress"
SILENT_MIN_S = 5.0  # a watcher kept from the interpreter this long by a long call is not yet "not responding"
NEVER_HEARD_S = 60.0  # a rank not heard from at all is given this long to start (imports differ by host)
# The verdict's named processes ({"host", "pid"} each), for the launchers' agents (sft.distributed.torchrun ends a
# stopped worker of its own that the store names here: a frozen process acts on no signal but SIGKILL).
VERDICT_KEY = "sft/progress/verdict"


class Record:
    """This process's progress, written by the training thread and read by the watcher (attribute writes are
    atomic under the GIL; a reader may see a phase with the previous step, which only shifts a report by one step).

    Attributes:
        step: the optimizer step worked on (1-based: ``global_step + 1`` while the step runs; the step just done
            while logging, evaluating and saving after it); 0 before training.
        phase: what this rank does (the constants above, or "start", "loading the model", "data preparation", ...).
        waiting: the collective or wait it is blocked in (e.g. "barrier", "waiting for data shards"), or None.
        since: ``time.time()`` when the phase (or wait) began, shown to the user as "N s ago".
        seq: moves on every phase change and :meth:`advance`; the progress that is judged.
        work: the straggler window this rank publishes (:mod:`sft.train.stragglers`), or None.
    """

    def __init__(self) -> None:
        self.step = 0
        self.phase = "start"
        self.waiting: Optional[str] = None
        self.since = time.time()
        self.seq = 0
        self.work: Optional[dict] = None

    def set(self, phase: str, step: Optional[int] = None) -> None:
        """Enter ``phase`` (at optimizer step ``step``, if given): progress."""
        if step is not None:
            self.step = int(step)
        self.phase, self.since = phase, time.time()
        self.seq += 1

    def advance(self) -> None:
        """Progress inside the current phase (a micro batch, an evaluation batch)."""
        self.seq += 1

    @contextlib.contextmanager
    def wait(self, what: str):
        """Mark the block as a wait for other ranks (a collective, a file another rank writes). Entering and leaving
        are progress; while inside, this rank is "waiting", so it is not the one named when all stall."""
        outer, self.waiting = self.waiting, what
        self.seq += 1
        try:
            yield
        finally:
            self.waiting = outer
            self.seq += 1


RECORD = Record()
HOST = socket.gethostname()


def where(beat: dict) -> str:
    """``"forward and backward of step 87"`` (+ ``", waiting in barrier"``) for a published beat."""
    text = f"{beat['phase']} of step {beat['step']}" if beat.get("step") else beat["phase"]
    return text + (f", waiting in {beat['waiting']}" if beat.get("waiting") else "")


@dataclass
class Seen:
    """One rank as a watcher sees it: its latest beat (None before any) and when (watcher's monotonic clock) its
    progress and liveness counters last moved."""

    beat: Optional[dict]
    progress_at: float
    tick_at: float

    def update(self, beat: dict, now: float) -> None:
        if self.beat is None or beat["seq"] != self.beat["seq"]:
            self.progress_at = now
        if self.beat is None or beat["tick"] != self.beat["tick"]:
            self.tick_at = now
        self.beat = beat


@dataclass
class Verdict:
    """What :func:`judge` found: ``kind`` "not responding", "stuck" or "store lost"; ``ranks`` named (empty for
    "store lost"); ``stalled_s``: how long the named ranks' progress stood still; ``every_rank``: all ranks are
    named (stuck together in the same place)."""

    kind: str
    ranks: list = field(default_factory=list)
    stalled_s: float = 0.0
    every_rank: bool = False


def judge(seen: dict, now: float, timeout_s: float, store_ok_at: float) -> Optional[Verdict]:
    """The verdict for ``seen`` (global rank -> :class:`Seen`, one per rank of the world) at monotonic ``now``, or
    None while nothing stood still for ``timeout_s`` seconds; see the module docstring for the rules.
    ``store_ok_at``: when the store last answered."""
    if now - store_ok_at >= timeout_s:
        return Verdict("store lost", [], now - store_ok_at)
    silent, stuck, falling_silent = [], [], False
    quiet_s = max(timeout_s / 2, 3 * interval_for(timeout_s), SILENT_MIN_S)
    for r, s in sorted(seen.items()):
        stalled = now - s.progress_at
        if s.beat is not None and s.beat["phase"] == FINISHED:
            continue
        if stalled < (timeout_s if s.beat is not None else max(timeout_s, NEVER_HEARD_S)):
            # ticks stopped, progress not yet still for the timeout (its last step ended after the others' did)
            falling_silent |= s.beat is not None and now - s.tick_at >= quiet_s
            continue
        if now - s.tick_at >= quiet_s:
            silent.append(r)
        elif s.beat is not None and s.beat["phase"] in STEP_PHASES and not s.beat.get("waiting"):
            stuck.append(r)
    if silent:
        return Verdict("not responding", silent, max(now - seen[r].progress_at for r in silent))
    if stuck and not falling_silent:  # a rank that stopped answering is the likelier cause: wait for its verdict
        def position(r):
            b = seen[r].beat
            return (b["step"], _ORDER.get(b["phase"], len(_ORDER)))
        first = min(position(r) for r in stuck)
        behind = [r for r in stuck if position(r) == first]
        return Verdict("stuck", behind, max(now - seen[r].progress_at for r in behind), len(behind) == len(seen))
    return None


def rank_ranges(ranks: list) -> str:
    """``[0, 2, 3, 4]`` -> ``"0, 2-4"``."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def verdict_lines(v: Verdict, seen: dict, now_wall: float, timeout_s: float, store: str) -> list:
    """One line per named rank (or one for the store), as every surviving process logs them."""
    if v.kind == "store lost":
        return [f"hang: the job's c10d store at {store} (served on the host of MASTER_ADDR) has not answered for "
                f"{v.stalled_s:.0f} s (--hang_timeout {timeout_s:g})"]
    lines = []
    for r in v.ranks:
        b = seen[r].beat
        if b is None:
            lines.append(f"hang: rank {r} has not reported any progress for {v.stalled_s:.0f} s since this watcher "
                         f"started (--hang_timeout {timeout_s:g}): it never started or froze at once")
            continue
        state = "and stopped answering (not responding)" if v.kind == "not responding" else "while its process runs"
        lines.append(f"hang: rank {b['rank']} (host {b['host']}, node rank {b['node_rank']}, pid {b['pid']}) made no "
                     f"progress for {v.stalled_s:.0f} s {state}: its last beat "
                     f"({max(0.0, now_wall - b.get('at', b['since'])):.0f} s ago) had it in {where(b)} for "
                     f"{max(0.0, b.get('at', b['since']) - b['since']):.0f} s (--hang_timeout {timeout_s:g})")
    return lines


def verdict_paragraph(v: Verdict, seen: dict, timeout_s: float, store: str) -> str:
    """The one paragraph that ends the job: what stopped, where the others waited, what to do next."""
    others: dict = {}
    for r, s in sorted(seen.items()):
        if r not in v.ranks and s.beat is not None:
            others.setdefault(where(s.beat), []).append(r)
    waited = "; ".join(f"rank(s) {rank_ranges(rs)} in {w}" for w, rs in others.items())
    dumps = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")  # set on CUDA (sft.distributed.process_group)
    flight = (f" NCCL's flight recorder writes each rank's last collectives to {dumps}<rank> when a collective times "
              "out: docs/multi-node.md ('When a job hangs or crawls') says how to read them." if dumps else "")
    if v.kind == "store lost":
        head = (f"training stopped: the c10d store at {store} stopped answering for {v.stalled_s:.0f} s, so no rank "
                "can see the others' progress: the host of MASTER_ADDR (node rank 0) froze, or lost its network. "
                "Look at that host first (dmesg, a stopped or swapping process, its network link).")
    elif v.kind == "not responding":
        hosts = sorted({seen[r].beat["host"] for r in v.ranks if seen[r].beat})
        where_ = f"on host(s) {', '.join(hosts)}" if hosts else "(never heard from: host unknown)"
        head = (f"training stopped: rank(s) {rank_ranges(v.ranks)} {where_} stopped answering "
                f"and made no progress for {v.stalled_s:.0f} s (--hang_timeout {timeout_s:g}): a stopped or frozen "
                "process or node (a hung GPU driver call -- look for Xid errors in dmesg --, swapping, a SIGSTOP, "
                "a node that froze). Look at that host first.")
    elif v.every_rank:
        head = (f"training stopped: every rank made no progress for {v.stalled_s:.0f} s (--hang_timeout "
                f"{timeout_s:g}) while running, all in the same place: a collective that never completes (a network "
                "fault, ranks calling different collectives) or a deadlock that every rank meets. Each rank's Python "
                "stack above shows where it waits.")
    else:
        head = (f"training stopped: rank(s) {rank_ranges(v.ranks)} made no progress for {v.stalled_s:.0f} s "
                f"(--hang_timeout {timeout_s:g}) while their processes ran, behind the others: look at the stack the "
                "named rank(s) wrote just above (a data loader that never returns, a deadlock, a hung file system).")
    tail = (f" The other ranks waited: {waited}." if waited else "") + flight + (
        " Every process exits with code 1; an elastic job (NNODES=MIN:MAX) restarts from the last complete "
        "checkpoint without a node that stopped answering. --hang_timeout sets the wait (0: off).")
    return head + tail


def parent_pid(pid: int) -> Optional[int]:  # from /proc/PID/stat (Linux); None when gone or unreadable
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def end_frozen_sibling(beat: dict) -> bool:
    """SIGKILL the process of ``beat`` when it is a worker of this process's own torchrun agent on this host (same
    host name, same parent process, not this one): a stopped process does not act on the agent's SIGTERM.
    Returns True when it sent the signal."""
    pid = int(beat.get("pid", 0))
    if beat.get("host") != HOST or pid in (0, os.getpid()) or os.getppid() in (0, 1) or parent_pid(pid) != os.getppid():
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except OSError:
        return False


def _write(text: str) -> None:
    os.write(2, text.encode("utf-8", "replace"))  # no logging lock: the training thread may hold one


class Watcher(threading.Thread):
    """Publishes this process's :class:`Record` and judges every rank's; see the module docstring.

    Args:
        store: a ``torch.distributed.Store`` client of the job's store (its own connection; a call that does not
            answer within its timeout raises).
        token: the same string on every rank of this round (elastic rounds share the store).
        rank, world_size: this process's global rank and the number of ranks.
        timeout_s: ``--hang_timeout`` (0: publish only, never judge -- the straggler report still reads beats).
        interval_s: seconds between publishes.
        identity: host, pid, node rank and local rank as published.
        on_verdict: called with ``(verdict, watcher)`` on the first verdict (default: :meth:`end_job`).
        store_name: ``host:port`` of the store, as named in a report.
    """

    def __init__(self, store, token: str, rank: int, world_size: int, timeout_s: float, interval_s: float,
                 identity: dict, record: Record = RECORD, on_verdict: Optional[Callable] = None,
                 store_name: str = "?"):
        super().__init__(name="sft-progress-watcher", daemon=True)
        self.store, self.token, self.rank, self.world_size = store, token, int(rank), int(world_size)
        self.timeout_s, self.interval_s = float(timeout_s), float(interval_s)
        self.identity, self.record = dict(identity), record
        self.on_verdict = on_verdict or (lambda verdict, watcher: watcher.end_job(verdict))
        self.store_name = store_name
        now = time.monotonic()
        self.seen = {r: Seen(None, now, now) for r in range(self.world_size)}
        self.store_ok_at = now
        self.tick = 0
        self.present: set = set()
        self.verdict: Optional[Verdict] = None
        self._stopping = threading.Event()
        atexit.register(self.stop, finished=False)  # a run that ends without stop(): an error, a preemption

    def key(self, rank: int) -> str:
        return f"{KEY_PREFIX}/{self.token}/{rank}"

    def beat(self) -> dict:
        """This rank's beat as published (JSON-able)."""
        r = self.record
        return dict(self.identity, rank=self.rank, step=r.step, phase=r.phase, waiting=r.waiting, since=r.since,
                    seq=r.seq, tick=self.tick, work=r.work, at=time.time())

    def beats(self) -> dict:  # the latest beat of every rank seen so far (global rank -> dict), this rank's fresh
        out = {r: s.beat for r, s in self.seen.items() if s.beat is not None}
        out[self.rank] = self.beat()
        return out

    def poll(self, now: float) -> Optional[Verdict]:
        """Publish, read, judge once (the thread calls this every ``interval_s``). Returns the verdict, if any."""
        self.tick += 1
        try:
            self.store.set(self.key(self.rank), json.dumps(self.beat()))
            missing = [r for r in range(self.world_size) if r not in self.present]
            for r in missing:
                if self.store.check([self.key(r)]):
                    self.present.add(r)
            ranks = sorted(self.present)
            if ranks:
                for r, raw in zip(ranks, self.store.multi_get([self.key(r) for r in ranks])):
                    self.seen[r].update(json.loads(raw), now)
            self.store_ok_at = now
        except Exception:  # noqa: BLE001 -- the store did not answer in time (or its host is gone): judged below
            pass
        self.seen[self.rank].update(self.beat(), now)  # this rank's own view never waits for the store
        if self.timeout_s <= 0:
            return None
        return judge(self.seen, now, self.timeout_s, self.store_ok_at)

    def run(self) -> None:
        while True:  # the first beat at once: a rank frozen a moment after starting is still placed
            verdict = self.poll(time.monotonic())
            if verdict is not None and not self._stopping.is_set():
                self.verdict = verdict
                self.on_verdict(verdict, self)
                return
            if self._stopping.wait(self.interval_s):
                return

    def stop(self, finished: bool = True) -> None:
        """Stop the thread and wait (30 s at most) until it has left its store call: a daemon thread that comes back
        from C++ while Python finalizes aborts the process (exit 134). Also runs at exit. With ``finished``, publish
        a last beat that says so (a rank that left cleanly is never named while the others finish)."""
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(30.0)
        if finished:
            self.record.set(FINISHED)
            with contextlib.suppress(Exception):
                self.store.set(self.key(self.rank), json.dumps(self.beat()))

    def end_job(self, verdict: Verdict) -> None:
        """Log the lines, this process's stacks and (lowest live rank per host) the paragraph; end a frozen
        sibling; exit with the lost-peer code."""
        me = f"[sft rank{self.rank}]"
        lines = verdict_lines(verdict, self.seen, time.time(), self.timeout_s, self.store_name)
        _write("".join(f"{me} ERROR {line}\n" for line in lines))
        named = [{"rank": r, **({"host": b["host"], "pid": b["pid"]} if (b := self.seen[r].beat) else {})}
                 for r in verdict.ranks if verdict.kind == "not responding"]
        if named:
            with contextlib.suppress(Exception):
                self.store.set(VERDICT_KEY, json.dumps(named))
        if verdict.kind == "not responding":
            for r in verdict.ranks:
                b = self.seen[r].beat
                if b is not None and end_frozen_sibling(b):
                    _write(f"{me} ERROR hang: ended rank {r} (pid {b['pid']}, a worker of this node's agent) with "
                           "SIGKILL: a stopped process does not act on SIGTERM\n")
        _write(f"{me} ERROR hang: this process's Python stacks (rank {self.rank}, host {self.identity['host']}, pid "
               f"{os.getpid()}), where it was when the hang was found:\n")
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        live_here = [r for r, s in self.seen.items() if r not in verdict.ranks and s.beat is not None
                     and s.beat["host"] == self.identity["host"]]
        if self.rank == min(live_here + [self.rank]):
            _write(f"{me} ERROR " + verdict_paragraph(verdict, self.seen, self.timeout_s, self.store_name) + "\n")
        report_exit_code(PEER_LOST_EXIT_CODE)
        if named:  # the launchers' guards read the named processes from the store every 2 s: let them see it
            time.sleep(3.0)
        os._exit(PEER_LOST_EXIT_CODE)


_WATCHER: Optional[Watcher] = None


def current() -> Optional[Watcher]:
    """The watcher of this process, or None (one process, not under torchrun, or switched off)."""
    return _WATCHER


def set_current(watcher: Optional[Watcher]) -> None:
    """Make ``watcher`` this process's (:func:`sft.distributed.process_group.start_progress_watcher` starts it)."""
    global _WATCHER
    _WATCHER = watcher


def interval_for(timeout_s: float) -> float:
    """Seconds between beats: a tenth of ``--hang_timeout``, between 0.5 and 5 s (5 s when it is 0)."""
    return 5.0 if timeout_s <= 0 else min(5.0, max(0.5, timeout_s / 10))


def stop() -> None:
    """Stop this process's watcher after a clean finish (publishes "finished"); a no-op without one."""
    global _WATCHER
    if _WATCHER is not None:
        _WATCHER.stop(finished=True)
        _WATCHER = None
