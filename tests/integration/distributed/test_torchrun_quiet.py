"""sft.distributed.torchrun: torchrun's main with a quiet exit on a signal (finetune/launch.sh starts it)."""
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from sft.distributed import torchrun


def test_signal_is_a_quiet_exit_code(monkeypatch, capsys):
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    seen = []

    def stopped(argv):
        seen.append(argv)
        logging.getLogger(torchrun._AGENT_LOGGER).warning("Received 15 death signal, shutting down workers")
        raise SignalException("got signal", sigval=signal.SIGTERM)

    monkeypatch.setattr(run, "main", stopped)
    before = {s: signal.getsignal(s) for s in torchrun._STOP_SIGNALS}
    try:
        assert torchrun.main(["--nproc_per_node", "2", "train.py", "--x", "1"]) == 128 + signal.SIGTERM
        # from the death signal on, the shutdown is not interrupted by another one
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in torchrun._STOP_SIGNALS)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert seen == [["--nproc_per_node", "2", "train.py", "--x", "1"]]  # arguments passed through unchanged
    assert "death signal" not in capsys.readouterr().err


def test_a_second_signal_does_not_cut_the_shutdown_short(tmp_path):
    """A real torchrun: SIGTERM, then two more while its worker is still saving (srun sends SIGTERM again when it
    forces a step's end; a user presses Ctrl-C twice). torchrun waits for the worker as after one signal: the
    worker's last file exists when torchrun exits 143, the worker was signalled once, and no traceback (torch's
    handler raised inside the shutdown; once mid-write in a log record: logging's "--- Logging error ---" in a
    real SLURM node-loss job log)."""
    script = tmp_path / "worker.py"
    script.write_text("import pathlib, signal, sys, time\n"
                      "d = pathlib.Path(sys.argv[1])\n"
                      "def saving(*_):\n"
                      "    (d / 'term').write_text('1'); time.sleep(3); (d / 'saved').write_text('1'); sys.exit(0)\n"
                      "signal.signal(signal.SIGTERM, saving)\n"
                      "(d / 'up').write_text('1')\n"
                      "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-m", "sft.distributed.torchrun", "--nproc_per_node", "1",
                          "--master_port", "0", str(script), str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for name in ("up", "term"):
            deadline = time.monotonic() + 60
            while not (tmp_path / name).exists():
                assert p.poll() is None and time.monotonic() < deadline, (name, p.communicate(timeout=30))
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)  # a third: torch's own second shutdown (its run()'s finally) was cut short too
        _, err = p.communicate(timeout=60)
        saved = (tmp_path / "saved").exists()  # read at once: a torchrun that left early finds it missing
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert saved, err
    assert err.count("closing signal SIGTERM") == 1, err
    assert "Traceback" not in err and "Logging error" not in err, err


def test_other_outcomes_are_torchruns(monkeypatch):
    from torch.distributed import run

    monkeypatch.setattr(run, "main", lambda argv: None)
    assert torchrun.main(["x.py"]) == 0

    def failed(argv):
        raise SystemExit(1)

    monkeypatch.setattr(run, "main", failed)
    with pytest.raises(SystemExit) as e:
        torchrun.main(["x.py"])
    assert e.value.code == 1


def test_bad_arguments_exit_like_torchrun():
    r = subprocess.run([sys.executable, "-m", "sft.distributed.torchrun", "--nproc_per_node", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "the following arguments are required: training_script" in r.stderr, r.stderr


def test_failed_worker_is_one_line_and_its_exit_code(tmp_path):
    """A real torchrun whose rank 1 exits 3 (rank 0 waits to be stopped): no traceback, no "FAILED" report,
    one line naming the rank, the code and where the worker's output is; torchrun's exit code is the worker's."""
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    print('worker 1: giving up', file=sys.stderr, flush=True); sys.exit(3)\n"
                      "time.sleep(60)\n")
    codes = tmp_path / "codes"
    r = subprocess.run([sys.executable, "-m", "sft.distributed.torchrun", "--nproc_per_node", "2",
                        "--master_port", "0", str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SFT_EXIT_CODE_FILE": str(codes)})
    assert r.returncode == 3, r.stderr
    assert codes.read_text() == "torchrun 3\n"  # what finetune/launch.sh reads when its wait lost the code
    assert "Traceback" not in r.stderr and "FAILED" not in r.stderr and "failed (exitcode" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("torchrun: ")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("torchrun: global rank 1 (local rank 1 on this node, pid "), lines[0]
    assert "exited with code 3 (1 other worker(s) of this node stopped after it)" in lines[0], lines[0]
    assert "above in this log" in lines[0], lines[0]
    assert "worker 1: giving up" in r.stderr  # the worker's own words stay


def test_worker_ended_by_a_signal_gives_128_plus_the_signal():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    err = ChildFailedError("finetune.py", {2: ProcessFailure(local_rank=0, pid=42, exitcode=-9, error_file="<N/A>")})
    line, code = torchrun.failure_line(err, ["--log-dir", "/logs", "--nproc_per_node", "1", "finetune.py", "--x"])
    assert code == 128 + 9
    assert line == ("torchrun: global rank 2 (local rank 0 on this node, pid 42) was ended by SIGKILL; "
                    "its output is under /logs (torchrun's --log-dir) and above in this log")


def test_broken_exit_barrier_is_one_line_without_a_traceback(monkeypatch):
    """torch 2.13's agent logs "Error waiting on exit barrier" with logger.exception when the master's store
    closes while this node's agent still waits at the end of a run (seen in a real 3-node SLURM job log)."""
    from torch.distributed import DistNetworkError, run

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(logging.Formatter("%(levelname)s %(message)s").format(record))

    agent = logging.getLogger(torchrun._AGENT_LOGGER)
    keep = Keep()
    agent.addHandler(keep)

    def finished_then_barrier_breaks(argv):
        try:
            raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.\nmore")
        except DistNetworkError:
            agent.exception("Error waiting on exit barrier. Elapsed: %s seconds", 0.004)

    monkeypatch.setattr(run, "main", finished_then_barrier_breaks)
    try:
        assert torchrun.main(["x.py"]) == 0
    finally:
        agent.removeHandler(keep)
        agent.removeFilter(torchrun._exit_barrier_line)
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert "exit barrier" in lines[0] and "DistNetworkError: Failed to recv, got 0 bytes" in lines[0]
    assert "their result stands" in lines[0] and "more" not in lines[0]


# ------------------------------------------------------------------------------------------------- elastic jobs

def _emit(logger_name, msg, *args):
    logging.getLogger(logger_name).info(msg, *args)


def test_elastic_rounds_and_restarts_are_one_line_each(monkeypatch, caplog):
    """The messages exactly as torch 2.13's agent (agent/server/api.py) and c10d rendezvous log them at INFO."""
    from torch.distributed import run

    def elastic(argv):
        _emit(torchrun._RDZV_LOGGER, "The node 'h1_1_0' has joined round 0 of the rendezvous 'job7' as rank 1 in a "
              "world of size 3.")
        _emit(torchrun._AGENT_LOGGER, "[%s] starting workers for entrypoint: %s", "default", "python")
        _emit(torchrun._AGENT_LOGGER, "[%s] Worker group %s. %s/%s attempts left; will restart worker group",
              "default", "FAILED", 3, 3)
        _emit(torchrun._RDZV_LOGGER, "The node 'h1_1_0' attempts to join the next round of the rendezvous 'job7'.")
        _emit(torchrun._RDZV_LOGGER, "The node 'h1_1_0' has joined round 1 of the rendezvous 'job7' as rank 0 in a "
              "world of size 2.")
        _emit(torchrun._AGENT_LOGGER, "[%s] Detected %s new nodes from group_rank=%s; will restart worker group",
              "default", 1, 0)

    monkeypatch.setattr(run, "main", elastic)
    caplog.set_level(logging.INFO)
    assert torchrun.main(["--nnodes", "2:3", "x.py"]) == 0
    err = "\n".join(r.getMessage() for r in caplog.records)
    assert "torchrun: rendezvous job7 round 0: this node is node rank 1 of 3 nodes" in err
    assert "torchrun: restart 1 of 3: the worker group FAILED" in err
    assert "torchrun: rendezvous job7 round 1: this node is node rank 0 of 2 nodes" in err
    assert "torchrun: 1 node(s) waiting to join; the worker group restarts to admit them" in err
    assert "starting workers" not in err and "attempts to join" not in err  # the rest of INFO stays hidden


def test_elastic_rendezvous_timeout_and_closed_rendezvous_are_one_line(monkeypatch, capsys):
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

    def timed_out(argv):
        raise RendezvousTimeoutError("The node 'h' has timed out")

    monkeypatch.setattr(run, "main", timed_out)
    assert torchrun.main(["x.py"]) == 2
    err = capsys.readouterr().err
    assert "did not gather enough nodes within its join timeout" in err and "Traceback" not in err

    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def unreachable(argv):
        raise RendezvousConnectionError("The connection to the C10d store has failed.") from TimeoutError("timed out")

    monkeypatch.setattr(run, "main", unreachable)
    assert torchrun.main(["x.py"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the elastic job's rendezvous store (timed out)" in err and "Traceback" not in err

    for exc in (RendezvousClosedError(), AttributeError("'NoneType' object has no attribute 'is_failed'")):
        def closed(argv, exc=exc):
            raise exc
        monkeypatch.setattr(run, "main", closed)
        assert torchrun.main(["x.py"]) == 1
        assert "rendezvous is closed" in capsys.readouterr().err


_ORPHAN = r"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "from sft.distributed.process_group import die_with_agent; "
                          "import time; print(die_with_agent(), flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)  # as torch 2.13 starts workers
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def test_a_worker_dies_with_its_agent():
    """An agent killed with SIGKILL takes its worker along (no orphan keeping the other nodes' collectives alive)."""
    env = dict(os.environ, TORCHELASTIC_RUN_ID="t")
    agent = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pid, armed = agent.stdout.readline().split()
        assert armed == "True"
        agent.kill()
        agent.wait(10)
        import time
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") and \
                "Z" not in open(f"/proc/{pid}/stat").read().split()[2]:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    finally:
        agent.kill()


def test_elastic_start_line():
    from sft.distributed.process_group import elastic_start_line

    assert elastic_start_line({}, 2, None) is None
    env = {"SFT_ELASTIC": "1", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
           "GROUP_WORLD_SIZE": "2"}
    line = elastic_start_line(env, 4, "/o/checkpoint-6")
    assert line == ("elastic: this round has world size 4 (2 node(s)); failures restarted so far on this node: 1 of 3; "
                    "resuming from /o/checkpoint-6")
    assert "starting from step 0" in elastic_start_line(env, 4, None)


_WATCHER_AT_EXIT = """
import datetime, os, signal, subprocess, sys, time
import torch.distributed as dist
from sft.distributed import watchdog

port, agent, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=20))
w = watchdog.Watcher(store, "tok", 0, 2, timeout_s=300, interval_s=0.2,
                     identity={"host": "h", "pid": os.getpid(), "node_rank": 0, "local_rank": 0})
watchdog.set_current(w)
w.start()
time.sleep(0.6)
os.kill(agent, signal.SIGSTOP)  # the agent paused (a loaded machine): the watcher's next beat waits for its answer
time.sleep(0.3)
subprocess.Popen(["sh", "-c", f"sleep 0.05; kill -CONT {agent}"])  # it answers while this process exits
if how == "clean":
    watchdog.stop()  # as finish_process_group ends a run
    sys.exit(0)
sys.exit(75)  # a run that ends otherwise (preempted)
"""


@pytest.mark.parametrize("how,code", [("clean", 0), ("preempted", 75)])
def test_a_watcher_beat_in_flight_at_exit_keeps_the_exit_code(tmp_path, how, code):
    """A worker exits while its progress watcher waits for the store's answer (the agent paused for a moment): the
    exit code is the run's own. Before stop() waited for the watcher's store call (also at exit, for a run that
    ended without it), the daemon thread came back from C++ while Python finalized: "terminate called without an
    active exception", SIGABRT, exit 134 (6 of 6 preempted exits, 2 of 3 clean ones, measured here)."""
    from tests.helpers.paths import pythonpath_env
    from tests.helpers.ports import free_port

    port = free_port()
    agent = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as d; "
                              f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
                              "time.sleep(120)"])
    try:
        r = subprocess.run([sys.executable, "-c", _WATCHER_AT_EXIT, str(port), str(agent.pid), how],
                           capture_output=True, text=True, timeout=120, env=pythonpath_env())
    finally:
        os.kill(agent.pid, signal.SIGCONT)
        agent.kill()
        agent.wait()
    assert r.returncode == code and "terminate called" not in r.stderr, r.stderr[-3000:]
