"""Faults during a background checkpoint write (``--save_async True``, docs/resume-and-preemption.md "Asynchronous
checkpoints") on the tiny model, injected at a known point of the write (tests/helpers/async_fault_worker.py: after
the checkpoint's first file): SIGKILL leaves that checkpoint without its marker and the next start resumes from the
one before; SIGTERM makes the stop wait for the write, save the final state and exit 75. Each resumed run ends with
the uninterrupted run's weights, bit for bit. A full disk during a background write is in
tests/integration/train/test_checkpoint_integrity.py, FSDP2 shards written in the background in
tests/integration/distributed/test_fsdp.py, the rules in tests/unit/train/test_async_save.py."""
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from sft.errors import PREEMPTED_EXIT_CODE
from sft.train import checkpoint as ck
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port

STEPS = 6
SHAPES = {  # one process, full fine-tuning; two processes (DDP), LoRA
    "kill": (1, ["--learning_rate", "1e-3"], "model.safetensors"),
    "term": (2, ["--use_lora", "True", "--lora_r", "4", "--learning_rate", "1e-2"], "adapter_model.safetensors"),
}


def train(kind, model, data, out, fault=None):
    nproc, flags, _ = SHAPES[kind]
    entry = os.path.join(ROOT, "tests", "helpers", "async_fault_worker.py") if fault else \
        os.path.join(ROOT, "finetune.py")
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port())]
    cmd = [*launch, entry, "--model_name_or_path", model, "--data_path", data, "--output_dir", str(out),
           "--max_steps", str(STEPS), "--per_device_train_batch_size", "2", "--save_strategy", "steps",
           "--save_steps", "2", "--save_total_limit", "2", "--logging_steps", "1", "--report_to", "none",
           "--disable_tqdm", "True", "--seed", "3", "--save_async", "True", *flags]
    env = pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1", **({"SFT_TEST_FAULT": fault} if fault else {})})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.parametrize("kind", ["kill", "term"])
def test_a_fault_during_a_background_write_resumes_exactly(kind, tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "toy.jsonl", TOY)
    ref = train(kind, tiny_model_dir, data, tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "out"
    r = train(kind, tiny_model_dir, data, out, fault=f"{kind}:4")
    if kind == "kill":
        assert r.returncode == -9, r.stderr[-3000:]
        # killed after the weights of checkpoint-4 were written: on disk, but no marker
        assert os.path.isfile(out / "checkpoint-4" / SHAPES[kind][2]) and not ck.is_complete(str(out / "checkpoint-4"))
        assert ck.latest_complete(str(out)) == str(out / "checkpoint-2")
    else:
        # every rank exits 75 (torchrun itself then exits 1; finetune/launch.sh passes the 75 on)
        assert r.returncode == 1 and r.stderr.count(f"(exitcode: {PREEMPTED_EXIT_CODE})") == 1, r.stderr[-3000:]
        assert "waited" in r.stderr and f"for the background write of {out}/checkpoint-4 to finish" in r.stderr
        assert "preempted: stopped by SIGTERM at step 5" in r.stderr and "[rank0]: Traceback" not in r.stderr
        assert ck.verify(str(out / "checkpoint-4")) is None and ck.verify(str(out / "checkpoint-5")) is None
    resumed = train(kind, tiny_model_dir, data, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out}/checkpoint-{2 if kind == 'kill' else 5}" in resumed.stderr
    name = SHAPES[kind][2]
    a, b = load_file(str(out / name)), load_file(str(tmp_path / "ref" / name))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
