"""Checkpoint integrity with real training runs (docs/resume-and-preemption.md "Integrity"): a flipped byte and a
truncated file in saved checkpoints (a named damaged checkpoint is refused; ``auto`` falls back past both and ends
with the uninterrupted run's adapter, bit for bit), and a save into a full tmpfs output folder (root only): exit 2
with one message and no traceback, the previous checkpoint verified and resumable to the same adapter. The rules
themselves are in tests/unit/train/test_checkpoint_integrity.py."""
import os
import shutil
import subprocess
import sys

import pytest

from sft.train import checkpoint as ck
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.files import flip_byte
from tests.helpers.paths import ROOT, pythonpath_env

STEPS = 3  # a checkpoint after every step: two can be damaged and one is left to fall back to


def train(model, data, out, *extra):
    cmd = [sys.executable, os.path.join(ROOT, "finetune.py"), "--model_name_or_path", model, "--data_path", data,
           "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
           "--learning_rate", "1e-2", "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1",
           "--report_to", "none", "--disable_tqdm", "True", "--use_lora", "True", "--lora_r", "4", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=pythonpath_env())


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """An uninterrupted run: ``(data file, its output folder, its final adapter's bytes)``."""
    base = tmp_path_factory.mktemp("integrity")
    data = write_jsonl(base / "toy.jsonl", TOY)
    r = train(tiny_model_dir, data, base / "ref")
    assert r.returncode == 0, r.stderr[-3000:]
    return data, base / "ref", (base / "ref" / "adapter_model.safetensors").read_bytes()




def test_damaged_checkpoints_named_are_refused_and_auto_falls_back_to_the_same_result(reference, tiny_model_dir,
                                                                                     tmp_path):
    data, ref, adapter = reference
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    flip_byte(out / "checkpoint-3" / "adapter_model.safetensors", offset=1000)
    os.truncate(out / "checkpoint-2" / "optimizer.pt", os.path.getsize(out / "checkpoint-2" / "optimizer.pt") // 2)
    named = train(tiny_model_dir, data, out, "--resume_from_checkpoint", str(out / "checkpoint-3"))
    assert named.returncode == 2, named.stderr[-3000:]
    assert (f"--resume_from_checkpoint {out}/checkpoint-3: fails verification: adapter_model.safetensors: its xxh3_128 "
            "checksum differs") in named.stderr and "Traceback" not in named.stderr
    assert "resuming from" not in named.stderr  # refused before loading anything

    r = train(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stderr
    assert (f"WARNING not resuming from {out}/checkpoint-3: adapter_model.safetensors: its xxh3_128 checksum differs "
            f"from the one recorded when it was saved (the bytes changed on disk); resuming from the previous complete "
            f"checkpoint {out}/checkpoint-1 instead") in log, log[-3000:]
    assert (f"WARNING not resuming from {out}/checkpoint-2: optimizer.pt has ") in log
    assert f"resuming from {out}/checkpoint-1" in log and "Traceback" not in log
    assert (out / "adapter_model.safetensors").read_bytes() == adapter  # nothing repeated, nothing lost
    assert all(ck.verify(str(out / f"checkpoint-{s}")) is None for s in (1, 2, 3))  # rewritten and verified


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 30 MiB tmpfs (one checkpoint of this run takes about 18 MiB, most of it tokenizer.json) mounted on a fresh
    folder, unmounted afterwards whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("extra", [[], ["--save_async", "True"]], ids=["sync", "async"])
def test_a_save_into_a_full_disk_ends_clearly_and_keeps_the_previous_checkpoint(reference, tiny_model_dir, small_tmpfs,
                                                                               tmp_path, extra):
    """async: the disk fills during checkpoint-2's background write; the error is raised at the next save."""
    data, _, adapter = reference
    out = small_tmpfs / "out"
    r = train(tiny_model_dir, data, out, *extra)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr
    assert "Traceback" not in err, err[-3000:]
    assert f"out of disk space while writing {out}/checkpoint-2/" in err, err[-3000:]
    assert f"MiB free of 30.0 MiB on the filesystem of --output_dir {out}" in err
    assert f"the previous complete checkpoint {out}/checkpoint-1 is intact and the next start resumes from it" in err
    assert "then run the same command again" in err
    assert ck.verify(str(out / "checkpoint-1")) is None and not ck.is_complete(str(out / "checkpoint-2"))
    assert ck.choose_resume(str(out), None, False) == str(out / "checkpoint-1")
    # the kept checkpoint resumes (into a folder with room) to the uninterrupted run's adapter
    r = train(tiny_model_dir, data, tmp_path / "roomy", "--resume_from_checkpoint", str(out / "checkpoint-1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "roomy" / "adapter_model.safetensors").read_bytes() == adapter
