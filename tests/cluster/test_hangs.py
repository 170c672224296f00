"""Hangs and slow nodes named (sft/distributed/watchdog.py, sft/train/stragglers.py, the launcher's worker guard in
sft/distributed/torchrun.py), with the real launcher:

* two namespace hosts (one process each): an even stretch names no straggler; rank 1 slowed to about half speed
  (SIGSTOP/SIGCONT cycling of its worker) is named with its host; then frozen (SIGSTOP), it is named with its host,
  last step and phase by rank 0, and every process of both hosts has ended within --hang_timeout + 60 s;
* two processes of one host: rank 0 -- the worker beside the store's host, node rank 0's launcher -- frozen, named
  by rank 1, and the job ends within the same bound.

A whole node frozen (launcher, agent and worker) and dropped by an elastic job is in tests/cluster/test_elastic.py.
Needs root for the namespaces (CI runs as root); skipped with the reason otherwise.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from tests.cluster.test_multinode import RUN_LIMIT_S, job, make_hosts, node_env, without_check  # noqa: F401
from tests.helpers import netns
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT

_WHY = netns.unavailable()
pytestmark = [pytest.mark.multinode, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

PRESET = os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh")  # DDP LoRA
HANG_TIMEOUT = 10
# micro batches of 8 samples: a forward pass of ~25 ms here, several SIGSTOP/SIGCONT cycles long, so a worker
# stopped half the time takes about twice as long per forward
FLAGS = ["--max_steps", "5000", "--lora_r", "4", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps",
         "1", "--save_strategy", "no", "--disable_tqdm", "True", "--logging_steps", "2", "--straggler_window", "10",
         "--hang_timeout", str(HANG_TIMEOUT), "--ddp_timeout", "120", "--lora_dropout", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows = [dict(r, id=f"{r['id']}-{k}") for k in range(10) for r in TOY]
    return write_jsonl(tmp_path_factory.mktemp("data") / "toy80.jsonl", rows)


def _cmdline(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def workers(pids) -> list:
    """The training workers among ``pids`` (``python -u .../finetune.py``, as torchrun starts them), by pid."""
    return sorted(p for p in pids
                  if (c := _cmdline(p)) and len(c) > 2 and c[1] == "-u" and c[2].endswith("finetune.py"))


def wait_for(cond, job, what, limit=RUN_LIMIT_S):
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {limit} s:\n" + job.tails()
        time.sleep(0.3)


class Slowdown(threading.Thread):
    """SIGSTOP / SIGCONT cycling of one process: stopped ``stopped_s`` of every ``stopped_s + running_s``."""

    def __init__(self, pid: int, stopped_s: float = 0.006, running_s: float = 0.005):
        super().__init__(daemon=True)
        self.pid, self.stopped_s, self.running_s = pid, stopped_s, running_s
        self.done = threading.Event()

    def run(self):
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.stopped_s)
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(self.running_s)
        except ProcessLookupError:
            pass

    def finish(self):
        self.done.set()
        self.join()


def _ended_within(job, t0: float, limit: float) -> list:
    rcs = []
    for p in job.procs:
        left = max(0.5, limit - (time.monotonic() - t0))
        try:
            rcs.append(p.wait(timeout=left))
        except Exception:  # noqa: BLE001
            pytest.fail(f"still running {limit:.0f} s after the freeze:\n" + job.tails())
    return rcs


def test_a_slowed_rank_is_named_then_frozen_it_ends_the_job(make_hosts, job, tmp_path, tiny_model_dir, data):
    hosts = make_hosts(2)
    out = tmp_path / "out"
    for i in range(2):
        env = node_env(NNODES=2, NODE_RANK=i, MASTER_ADDR=hosts.addrs[0], MASTER_PORT=6001,
                       PYTHON=without_check(tmp_path))  # what is named comes after the launcher's check
        job.start(hosts.cmd(i, ["bash", PRESET, "-m", tiny_model_dir, "-d", data, "--output_dir", str(out), *FLAGS]),
                  env, f"node{i}")
    # an even stretch: two full straggler windows and more, and no rank named
    # (the figures need a full window of both ranks' beats, published every second: on a quiet machine step 24
    # can come first)
    wait_for(lambda: re.search(r"step (2[4-9]|[3-9]\d|\d{3,})/5000", job.text(0)) and "'straggler_ratio'" in
             job.text(0), job, "step 24 and the straggler figures in the log line")
    assert "straggler:" not in job.text(0), job.tails()
    worker = workers(hosts.pids(1))
    assert len(worker) == 1, (worker, job.tails())
    slow = Slowdown(worker[0])
    t_slow = time.monotonic()
    slow.start()
    try:
        wait_for(lambda: f"straggler: rank 1 (host {hosts.hostnames[1]})" in job.text(0), job,
                 "rank 1 named as a straggler", 60)
    finally:
        slow.finish()
    named_after = time.monotonic() - t_slow
    os.kill(worker[0], signal.SIGCONT)
    os.kill(worker[0], signal.SIGSTOP)  # frozen for good
    t_freeze = time.monotonic()
    rcs = _ended_within(job, t_freeze, HANG_TIMEOUT + 60)
    took = time.monotonic() - t_freeze
    node0 = job.text(0)
    assert rcs[0] == 1, job.tails()
    m = re.search(rf"hang: rank 1 \(host {hosts.hostnames[1]}, node rank 1, pid {worker[0]}\) made no progress for "
                  rf"(\d+) s and stopped answering \(not responding\): its last beat \(\d+ s ago\) had it in (.+) "
                  rf"of step "
                  r"(\d+) for \d+ s", node0)
    assert m and int(m.group(1)) >= HANG_TIMEOUT, job.tails()
    assert "this process's Python stacks (rank 0" in node0 and "File " in node0, job.tails()
    assert f"training stopped: rank(s) 1 on host(s) {hosts.hostnames[1]} stopped answering" in node0, job.tails()
    assert "Traceback" not in node0, job.tails()
    assert "torchrun: ended worker process(es)" in job.text(1), job.tails()  # node 1's launcher ended its frozen worker
    assert not workers(hosts.pids(0) + hosts.pids(1))
    print(f"straggler named {named_after:.0f} s after the slowdown began; job ended {took:.0f} s after the freeze")


def test_a_frozen_rank_0_is_named_by_rank_1(job, tmp_path, tiny_model_dir, data):
    out = tmp_path / "out"
    env = node_env(NPROC_PER_NODE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=6003, PYTHON=without_check(tmp_path))
    launcher = job.start(["bash", PRESET, "-m", tiny_model_dir, "-d", data, "--output_dir", str(out), *FLAGS,
                          "--per_device_train_batch_size", "1", "--straggler_factor", "0"], env, "node0")
    wait_for(lambda: "step 4/5000" in job.text(0), job, "step 4")
    ranks = workers(_descendants(launcher.pid))
    rank0 = [p for p in ranks if "RANK=0" in _environ(p).splitlines()]
    assert len(ranks) == 2 and len(rank0) == 1, (ranks, job.tails())
    os.kill(rank0[0], signal.SIGSTOP)
    t_freeze = time.monotonic()
    rcs = _ended_within(job, t_freeze, HANG_TIMEOUT + 60)
    text = job.text(0)
    assert rcs == [1], job.tails()
    assert re.search(rf"\[sft rank1\] ERROR hang: rank 0 \(host \S+, node rank 0, pid {rank0[0]}\) made no progress "
                     r"for \d+ s and stopped answering", text), job.tails()
    assert "this process's Python stacks (rank 1" in text and "training stopped: rank(s) 0 on host(s)" in text
    assert "Traceback" not in text, job.tails()


def _descendants(pid: int) -> list:
    from sft.distributed.watchdog import parent_pid

    parents = {int(n): parent_pid(int(n)) for n in os.listdir("/proc") if n.isdigit()}
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def _environ(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return "\n".join(x.decode(errors="replace") for x in f.read().split(b"\0"))
    except OSError:
        return ""
