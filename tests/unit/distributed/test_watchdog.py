"""Progress beats and the hang verdict (sft/distributed/watchdog.py), the straggler comparison and the phase marks
of a training step (sft/train/stragglers.py), and the new flags' errors. The real runs (a frozen rank, node and a
slowed rank across torchrun processes) are in tests/cluster/test_hangs.py and tests/cluster/test_elastic.py."""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from sft.distributed import watchdog
from sft.distributed.watchdog import (
    FINISHED,
    FORWARD_BACKWARD,
    LOADING_BATCH,
    OPTIMIZER,
    SAVING,
    Record,
    Seen,
    Watcher,
    judge,
    verdict_lines,
    verdict_paragraph,
)

T = 10.0  # --hang_timeout of these cases


def beat(rank, step, phase, seq, tick, waiting=None, host="node0"):
    return {"rank": rank, "host": host, "pid": 100 + rank, "node_rank": rank // 2, "local_rank": rank % 2,
            "step": step, "phase": phase, "waiting": waiting, "since": 1000.0, "seq": seq, "tick": tick, "work": None}


def seen(b, progress_at, tick_at):
    return Seen(b, progress_at, tick_at)


def test_a_frozen_rank_is_named_before_the_ranks_that_wait_for_it():
    # rank 1 stopped answering at t=0 (ticks still); ranks 0, 2, 3 tick but stand still in the step (DDP's wait)
    s = {r: seen(beat(r, 87, FORWARD_BACKWARD, 5, 9), 0.0, 11.0) for r in (0, 2, 3)}
    s[1] = seen(beat(1, 87, FORWARD_BACKWARD, 5, 3, host="node1"), 0.0, 0.0)
    v = judge(s, now=11.0, timeout_s=T, store_ok_at=11.0)
    assert v.kind == "not responding" and v.ranks == [1] and v.stalled_s == 11.0
    line = verdict_lines(v, s, now_wall=1031.0, timeout_s=T, store="10.0.0.1:6001")[0]
    assert line.startswith("hang: rank 1 (host node1, node rank 0, pid 101) made no progress for 11 s and stopped "
                           "answering") \
        and "its last beat (31 s ago) had it in forward and backward of step 87 for 0 s" in line
    text = verdict_paragraph(v, s, T, "10.0.0.1:6001")
    assert "rank(s) 1 on host(s) node1 stopped answering" in text
    assert "The other ranks waited: rank(s) 0, 2-3 in forward and backward of step 87" in text


def test_nothing_before_the_timeout_and_never_a_finished_rank():
    s = {0: seen(beat(0, 5, FORWARD_BACKWARD, 5, 9), 0.0, 9.0), 1: seen(beat(1, 5, FINISHED, 5, 3), 0.0, 0.0)}
    assert judge(s, now=9.9, timeout_s=T, store_ok_at=9.9) is None  # under the timeout
    s[0] = seen(beat(0, 5, SAVING, 5, 30), 0.0, 30.0)  # alive in a phase that may run long: not judged here
    assert judge(s, now=30.0, timeout_s=T, store_ok_at=30.0) is None


def test_a_live_rank_stuck_behind_the_others_is_named_not_the_ones_waiting():
    # rank 2 never got its batch (alive, loading the next batch of step 88); the others wait in DDP's all-reduce of
    # step 88 or in the step-end agreement (a named collective: never the culprit)
    s = {0: seen(beat(0, 88, FORWARD_BACKWARD, 7, 20), 0.0, 20.0),
         1: seen(beat(1, 88, OPTIMIZER, 7, 20, waiting="collective all_reduce (MAX)"), 0.0, 20.0),
         2: seen(beat(2, 88, LOADING_BATCH, 7, 20), 0.0, 20.0)}
    v = judge(s, now=20.0, timeout_s=T, store_ok_at=20.0)
    assert (v.kind, v.ranks, v.every_rank) == ("stuck", [2], False)
    assert "while its process runs: its last beat (20 s ago) had it in loading the next batch of step 88" in \
        verdict_lines(v, s, 1020.0, T, "x")[0]
    # every rank alive and stuck in the same place: all named, and said so
    s = {r: seen(beat(r, 88, FORWARD_BACKWARD, 7, 20), 0.0, 20.0) for r in range(3)}
    v = judge(s, now=20.0, timeout_s=T, store_ok_at=20.0)
    assert v.every_rank and v.ranks == [0, 1, 2]
    assert "every rank made no progress for 20 s" in verdict_paragraph(v, s, T, "x")



def test_a_rank_waiting_for_a_peer_that_just_froze_is_not_named_stuck():
    # found on a slow machine (tests/cluster/test_hangs.py): rank 0 entered DDP's backward of step 40 at t=0 and
    # waits there (alive); rank 1 was frozen a moment later, its last progress seen at t=2.0, its last tick at t=3.0;
    # at t=10 rank 0 has stood still for the timeout, rank 1 not yet: no verdict until rank 1's is due
    s = {0: seen(beat(0, 40, FORWARD_BACKWARD, 9, 30), 0.0, 10.0),
         1: seen(beat(1, 40, FORWARD_BACKWARD, 9, 12, host="node1"), 2.0, 3.0)}
    assert judge(s, now=10.0, timeout_s=T, store_ok_at=10.0) is None
    v = judge(s, now=12.0, timeout_s=T, store_ok_at=12.0)
    assert (v.kind, v.ranks) == ("not responding", [1])
    # a peer that still ticks (alive, only slower) does not hold back the verdict on the stuck rank
    s[1] = seen(beat(1, 40, FORWARD_BACKWARD, 9, 12, waiting="collective all_reduce (MAX)"), 2.0, 10.0)
    assert judge(s, now=10.0, timeout_s=T, store_ok_at=10.0).ranks == [0]

def test_a_silent_store_and_a_rank_never_heard_from():
    s = {0: seen(beat(0, 3, FORWARD_BACKWARD, 1, 1), 0.0, 0.0)}
    v = judge(s, now=12.0, timeout_s=T, store_ok_at=1.0)
    assert v.kind == "store lost"
    assert "the job's c10d store at 10.0.0.1:6001" in verdict_lines(v, s, 0, T, "10.0.0.1:6001")[0]
    assert "host of MASTER_ADDR (node rank 0) froze" in verdict_paragraph(v, s, T, "10.0.0.1:6001")
    s = {0: seen(beat(0, 3, FORWARD_BACKWARD, 1, 9), 60.0, 60.0), 1: seen(None, 0.0, 0.0)}
    assert judge(s, now=59.0, timeout_s=T, store_ok_at=59.0) is None  # a minute to start: imports differ by host
    v = judge(s, now=61.0, timeout_s=T, store_ok_at=61.0)
    assert v.kind == "not responding" and v.ranks == [1]
    assert "rank 1 has not reported any progress for 61 s" in verdict_lines(v, s, 0, T, "x")[0]


def test_record_marks_waits_and_progress():
    r = Record()
    r.set(FORWARD_BACKWARD, 4)
    seq = r.seq
    with r.wait("collective barrier"):
        assert r.waiting == "collective barrier" and r.seq == seq + 1
    assert r.waiting is None and r.seq == seq + 2 and (r.step, r.phase) == (4, FORWARD_BACKWARD)
    r.advance()
    assert r.seq == seq + 3


def test_watchers_over_a_real_store_name_the_rank_that_stopped(monkeypatch):
    """Two watchers (ranks 0 and 1) publish through a real TCPStore; rank 1 stops polling (as a frozen process):
    rank 0's watcher names it once --hang_timeout has passed on its clock, and the default action's output."""
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=5))

    def client():
        return torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                                          timeout=datetime.timedelta(seconds=2))

    records = [Record(), Record()]
    found = []
    ws = [Watcher(client(), "tok", r, 2, timeout_s=4.0, interval_s=1.0, record=records[r],
                  identity={"host": f"h{r}", "pid": 10 + r, "node_rank": r, "local_rank": 0},
                  on_verdict=lambda v, w: found.append(v)) for r in (0, 1)]
    for k in range(3):
        for r in (1, 0):
            records[r].set(FORWARD_BACKWARD, k + 1)
            assert ws[r].poll(float(k)) is None
    assert ws[0].beats()[1]["host"] == "h1" and ws[0].beats()[1]["step"] == 3
    for k in range(3, 8):  # rank 1 frozen at k = 2: rank 0 keeps ticking, waiting
        v = ws[0].poll(float(k))
    assert v is not None and v.kind == "not responding" and v.ranks == [1]
    # a clean finish is published and never named
    ws[1].stop(finished=True)
    records[0].advance()
    assert ws[0].poll(8.0) is None and ws[0].seen[1].beat["phase"] == FINISHED


class _SlowStore:
    """A store whose ``set`` waits until released (an agent that answers late); counts the calls in flight."""

    def __init__(self):
        import threading

        self.entered, self.release, self.in_flight = threading.Event(), threading.Event(), 0

    def set(self, key, value):
        self.in_flight += 1
        self.entered.set()
        self.release.wait(10)
        self.in_flight -= 1

    def check(self, keys):
        return False


def test_stop_waits_for_the_store_call_in_flight():
    """stop() returns only after the watcher thread has left its store call: a daemon thread that comes back from a
    store call (C++) while Python finalizes aborts the process (tests/integration/distributed/test_torchrun_quiet.py
    shows the real exit); stop() also runs at exit for a run that ends without it."""
    import threading

    store = _SlowStore()
    w = Watcher(store, "tok", 0, 2, timeout_s=0, interval_s=0.05,
                identity={"host": "h", "pid": 1, "node_rank": 0, "local_rank": 0})
    w.start()
    assert store.entered.wait(10)
    threading.Timer(0.3, store.release.set).start()
    t0 = time.monotonic()
    w.stop(finished=False)
    assert time.monotonic() - t0 >= 0.2 and store.in_flight == 0 and not w.is_alive()
    w.stop(finished=False)  # again (as at exit after a clean stop): returns at once


def test_end_frozen_sibling_kills_only_a_worker_of_the_same_parent(tmp_path):
    """Two children of this test process stand for two workers of one agent: one stopped, the other ends it."""
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        stranger = {"host": watchdog.HOST, "pid": os.getpid()}  # this process: never
        code = (f"import sys; from sft.distributed.watchdog import end_frozen_sibling as e; "
                f"sys.exit(10 * e({stranger!r}) + e({{'host': {watchdog.HOST!r}, 'pid': {frozen.pid}}}))")
        rc = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd()).returncode
        assert rc == 1  # the sibling ended, its parent (this process) not
        assert frozen.wait(timeout=10) == -signal.SIGKILL
        assert not watchdog.end_frozen_sibling({"host": "elsewhere", "pid": frozen.pid})  # another host: never
    finally:
        frozen.kill()


def test_straggler_comparison_against_the_median_of_the_others():
    from sft.train.stragglers import compare

    # two ranks: each against the other's figure (a median including itself would hide a 2x straggler: 1.33x)
    r = compare({0: {"rate": 100.0}, 1: {"rate": 200.0}}, factor=1.5)
    assert r["slowest"] == 1 and r["ratios"][1] == 2.0 and r["named"] == [1] and r["median"] == 100.0
    r = compare({0: {"rate": 100.0}, 1: {"rate": 110.0}, 2: {"rate": 95.0}, 3: {"rate": 104.0}}, factor=1.5)
    assert r["named"] == [] and r["slowest"] == 1
    assert compare({0: {"rate": 100.0}}, 1.5) is None  # one rank: nothing to compare
    assert compare({0: {"rate": 100.0}, 1: {"rate": 300.0}}, factor=0)["named"] == []  # off


def test_phase_marks_of_a_step_and_the_published_window(monkeypatch):
    """The callback's marks through one optimizer step with logging and a save, and the forward timer's window."""
    from transformers import TrainerControl, TrainerState

    from sft.train.stragglers import ProgressCallback

    record = Record()
    monkeypatch.setattr("sft.train.stragglers.RECORD", record)
    model = torch.nn.Linear(4, 4)
    cb = ProgressCallback(model, factor=1.5, window=3)
    state, control = TrainerState(), TrainerControl()
    cb.on_train_begin(None, state, control)
    assert (record.phase, record.step) == (LOADING_BATCH, 1) and cb.warmup == 2
    cb.warmup = 0  # the first steps after a start are left out of the window; here the first one counts
    model.train()
    model(torch.zeros(2, 3, 4))  # a micro batch: forward and backward of step 1
    assert (record.phase, record.step) == (FORWARD_BACKWARD, 1)
    seq = record.seq
    model(torch.zeros(2, 3, 4))  # the second micro batch is progress in the same phase
    assert record.seq == seq + 1
    cb.on_pre_optimizer_step(None, state, control)
    assert record.phase == OPTIMIZER
    state.global_step, control.should_log, control.should_save = 1, True, True
    cb.on_step_end(None, state, control)
    assert (record.phase, record.step) == ("logging", 1)
    assert record.work["n"] == 1 and record.work["rate"] >= 0
    cb.on_log(None, state, control, logs={"loss": 1.0})
    assert record.phase == SAVING
    cb.on_save(None, state, control)
    assert (record.phase, record.step) == (LOADING_BATCH, 2)
    cb.on_train_end(None, state, control)
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("flags, fragment", [
    (["--hang_timeout", "1"], "--hang_timeout 1.0: must be 0 (off) or a number of seconds >= 2"),
    (["--hang_timeout", "-5"], "--hang_timeout -5.0: must be 0 (off)"),
    (["--hang_timeout", "900", "--ddp_timeout", "600"], "--hang_timeout 900 with --ddp_timeout 600: torch's timeout "
                                                        "would end the job first"),
    (["--straggler_factor", "0.8"], "--straggler_factor 0.8: must be 0 (off) or a ratio > 1"),
    (["--straggler_window", "1"], "--straggler_window 1: must be at least 2 optimizer steps"),
])
def test_bad_values_of_the_new_flags(tiny_model_dir, toy_data, tmp_path, flags, fragment):
    from sft.app.validation import validate
    from sft.config.arguments import parse_args
    from sft.errors import ConfigError

    m, d, t, l = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir",
                             str(tmp_path / "out"), *flags])
    with pytest.raises(ConfigError) as e:
        validate(m, d, t, l)
    assert fragment in str(e.value) and "invalid configuration:" in str(e.value)


def test_hang_timeout_default_and_flight_recorder_defaults(tmp_path):
    from sft.distributed.process_group import flight_recorder_defaults, hang_timeout_s

    assert hang_timeout_s(None, 1800) == 300 and hang_timeout_s(None, 100) == 50 and hang_timeout_s(None, 5) == 30
    assert hang_timeout_s(0, 30) == 0 and hang_timeout_s(12, 30) == 12
    env = {"TORCH_FR_BUFFER_SIZE": "50"}  # the user's own value stays
    set_here = flight_recorder_defaults(str(tmp_path / "out"), env)
    assert env["TORCH_FR_BUFFER_SIZE"] == "50" and "TORCH_FR_BUFFER_SIZE" not in set_here
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "out" / "nccl_trace" / "rank_")
    assert (tmp_path / "out" / "nccl_trace").is_dir()
    assert flight_recorder_defaults(None, {}) == {}


def test_the_launchers_guard_ends_a_stopped_worker_the_store_names():
    """sft/distributed/torchrun.py's WorkerGuard, as in a launcher: the store names a stopped child of this process
    (standing for a worker of the agent): the guard ends it with SIGKILL; a named process that is not its child is
    left alone. And the options it reads from torchrun's arguments."""
    from sft.distributed.torchrun import WorkerGuard, _option
    from sft.distributed.watchdog import VERDICT_KEY

    argv = ["--nproc_per_node", "1", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
            "--master_port", "6001", "/x/finetune.py", "--master_port", "7"]
    assert (_option(argv, "--master_addr"), _option(argv, "--master_port"), _option(argv, "--node_rank")) == \
        ("10.0.0.1", "6001", "1")
    assert _option(["--nnodes=2:3", "f.py"], "--nnodes") == "2:3" \
        and _option(["f.py", "--nnodes", "2"], "--nnodes") is None
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=5))
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        import json

        server.set(VERDICT_KEY, json.dumps([{"host": watchdog.HOST, "pid": frozen.pid},
                                            {"host": watchdog.HOST, "pid": os.getpid()}]))
        guard = WorkerGuard("127.0.0.1", server.port, serves=False)
        guard.poll(time.monotonic())
        assert frozen.wait(timeout=10) == -signal.SIGKILL
        assert guard.ended == {frozen.pid}  # this process is not its own child: untouched
    finally:
        frozen.kill()


def test_a_torch_timeout_message_says_where_each_rank_was_last_seen(monkeypatch):
    from sft.distributed.failures import explain_collective_failure

    w = Watcher(None, "t", 0, 3, timeout_s=0, interval_s=1, identity={"host": "h", "pid": 1, "node_rank": 0,
                                                                      "local_rank": 0})
    w.seen[0].update(beat(0, 40, "collective barrier", 1, 1), 0.0)
    w.seen[1].update(dict(beat(1, 40, SAVING, 1, 1), since=time.time() - 612), 0.0)
    w.seen[2].update(beat(2, 40, "collective barrier", 1, 1), 0.0)
    monkeypatch.setattr(watchdog, "_WATCHER", w)
    text = explain_collective_failure(RuntimeError("[gloo] Timed out waiting 600000ms for recv operation"), 600)
    assert "a collective got no answer within --ddp_timeout 600 s" in text
    assert "Last progress seen: rank(s) 0, 2 in collective barrier of step 40" in text
    assert "rank(s) 1 in saving a checkpoint of step 40 (since 61" in text
