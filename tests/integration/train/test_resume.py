"""Resume and preemption through real processes (README "Resume and preemption"): the watchdog's exit 75 in a
process of its own, then scripts/kill_resume_loop.py: SIGKILL at random moments in one process, and SIGTERM to
finetune/launch.sh with two torchrun processes; each resumed run must end with the uninterrupted run's weights,
bit for bit. The rules (completion marker, rotation, auto resume, signal handling) are in
tests/unit/train/test_resume.py.
"""
import os
import subprocess
import sys
import time

import pytest

from sft.errors import PREEMPTED_EXIT_CODE
from tests.helpers.launchers import without_check
from tests.helpers.paths import ROOT, pythonpath_env


def test_watchdog_exits_75_when_the_stop_takes_too_long(tmp_path):
    code_file = tmp_path / "codes"
    prog = ("import os, signal, time\n"
            "from sft.train.preemption import PreemptionHandler\n"
            "PreemptionHandler(timeout_s=1).install()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(60)  # a hung collective or save\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120,
                       env=pythonpath_env({**os.environ, "SFT_EXIT_CODE_FILE": str(code_file)}))
    assert r.returncode == PREEMPTED_EXIT_CODE, r.stderr[-2000:]
    assert time.monotonic() - t0 < 50
    assert "no clean stop within 1 s" in r.stderr and code_file.read_text() == "75\n"


def loop(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kill_resume_loop.py"), *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=pythonpath_env())


def test_sigkill_at_random_steps_then_resume_is_bit_exact(tmp_path):
    r = loop("--iterations", "1", "--steps", "6", "--kill_seed", "5", "--workdir", str(tmp_path))
    assert r.returncode == 0 and "exact: 1/1" in r.stdout, r.stdout + r.stderr[-3000:]
    assert r.stdout.count("] killed ") == 1  # really killed, not finished before the kill
    logs = open(tmp_path / "run0.log").read()
    assert "resuming from" in logs and "Traceback" not in logs


def test_sigkill_under_sequence_parallelism_then_resume_is_bit_exact(tmp_path):
    """Two processes sharing every row (--sequence_parallel_size 2), killed with SIGKILL at a random step, resumed:
    the same weights as the uninterrupted run."""
    r = loop("--iterations", "1", "--steps", "5", "--nproc", "2", "--kill_seed", "3", "--workdir", str(tmp_path),
             "--extra", "--sequence_parallel_size 2")
    assert r.returncode == 0 and "exact: 1/1" in r.stdout, r.stdout + r.stderr[-3000:]
    assert r.stdout.count("] killed ") == 1
    log = open(tmp_path / "run0.log").read()
    assert "resuming from" in log and "sequence-parallel size 2" in log and "Traceback" not in log


@pytest.mark.budget(300, reason="a torchrun reference, then two launches of finetune/launch.sh with 2 processes each "
                          "(the rendezvous preflight, torchrun): 103-114 s of wall time in CI with the check")
def test_sigterm_to_launcher_with_two_processes_exits_75_and_resumes_exactly(tmp_path):
    # without the launcher's sft check (what is proven comes after it; tests/helpers/launchers.py says which
    # launches still run it)
    r = loop("--iterations", "1", "--steps", "6", "--save_steps", "2", "--nproc", "2", "--launcher",
             "--signal", "TERM", "--kill_seed", "2", "--workdir", str(tmp_path), "--python", without_check(tmp_path))
    assert r.returncode == 0 and "exact: 1/1" in r.stdout, r.stdout + r.stderr[-3000:]
    assert f"SIGTERM -> exit {PREEMPTED_EXIT_CODE}" in r.stdout
    log = open(tmp_path / "run0.log").read()
    assert "preempted: stopped by SIGTERM at step" in log and "[rank 1] preempted" in log
    assert "resuming from" in log


# a whole trainer is built (over the unit tier's 5 s of CPU on a loaded machine)
def test_group_by_length_order_depends_on_seed_and_epoch_only(tiny_model_dir, toy_data, tmp_path):
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from sft.app.train import trainer_for
    from sft.config.arguments import parse_args
    from sft.train.trainer import EpochSeededLengthGroupedSampler

    args = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir",
                       str(tmp_path / "o"), "--group_by_length", "True", "--per_device_train_batch_size", "2",
                       "--report_to", "none", "--use_lora", "True", "--lora_r", "2"])
    trainer, _, _ = trainer_for(*args)
    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, EpochSeededLengthGroupedSampler)
    lengths = sampler.lengths

    def order(s, epoch, rng_seed):
        s.set_epoch(epoch) if hasattr(s, "set_epoch") else None
        torch.manual_seed(rng_seed)  # the global RNG differs between an uninterrupted and a resumed run
        return list(s)

    ours = EpochSeededLengthGroupedSampler(8, lengths * 8, seed=42)
    assert order(ours, 1, 0) == order(ours, 1, 123) != order(ours, 2, 0)
    theirs = LengthGroupedSampler(8, lengths=lengths * 8)
    assert order(theirs, 1, 0) != order(theirs, 1, 123)  # why the replacement exists
