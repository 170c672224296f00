"""Resume at another world size (docs/resume-and-preemption.md): DDP LoRA on the tiny model, trained at world size 2
to a checkpoint and resumed at world size 1 with the same global batch (gradient accumulation 2 -> 4). The resumed
run must equal a second resume of the same checkpoint at world size 1 bit for bit, consume per optimizer step exactly
the samples that an uninterrupted world-size-1 run with the same global batch consumes (nothing repeated, nothing
skipped), and end with its adapter within a tolerance that only the order of floating-point reductions explains.
Under DeepSpeed ZeRO-2 and ZeRO-3 the checkpoint is converted to a universal one first; the resumed run must
consume the samples of, and end with the adapter of, the uninterrupted world-size-2 run that wrote it.
The rules (planning, the refusal, validation) are in tests/unit/test_resume.py.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.data import write_jsonl
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port

STEPS, MICRO = 6, 2
# Measured here (fp32 on CPU): the adapter after 6 steps differs from the uninterrupted run's by at most 6.7e-8 and
# the losses by 9e-8 relative (the same sums in another order: two ranks' gradients all-reduced vs four micro batches
# accumulated in one process); the tolerances leave two orders of magnitude.
ADAPTER_ATOL, LOSS_RTOL = 1e-5, 1e-5


def _data(tmp_path):
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"item {i}: what comes after {i}?"},
                                             {"role": "assistant", "content": f"{i + 1} comes after {i}."}]}
               for i in range(32)]  # 32 samples = 4 global batches of 8: every step full, at any world size
    return write_jsonl(tmp_path / "d.jsonl", records)


def _run(tmp_path, name, nproc, model, data, grad_accum, *extra, steps=STEPS, save_steps=3):
    report = tmp_path / name
    report.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(ROOT, "tests", "helpers", "step_worker.py"),
           "--model_name_or_path", model, "--data_path", data, "--output_dir", str(tmp_path / f"{name}-out"),
           "--data_cache_dir", str(tmp_path / f"{name}-cache"),  # each run prepares its data at its world size
           "--use_lora", "True", "--lora_r", "4", "--lora_dropout", "0",
           "--per_device_train_batch_size", str(MICRO), "--gradient_accumulation_steps", str(grad_accum),
           "--max_steps", str(steps), "--learning_rate", "1e-2", "--save_strategy", "steps", "--save_steps",
           str(save_steps),
           "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "True", "--seed", "7", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1", "SFT_TEST_REPORT_DIR": str(report)}))
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.load(open(report / f"rank{i}.json")) for i in range(nproc)]
    by_step = {}  # optimizer step -> the samples it consumed on every rank together
    for rank in ranks:
        chunk = MICRO * rank["grad_accum"]
        for i in range(steps - rank["first_step"] + 1):
            by_step.setdefault(rank["first_step"] + i, []).extend(rank["seen"][i * chunk:(i + 1) * chunk])
    losses = {int(k): v for k, v in ranks[0]["losses"].items()}
    return r.stderr, by_step, losses, load_file(str(tmp_path / f"{name}-out" / "adapter_model.safetensors"))


def test_lora_ddp_resumed_at_another_world_size_continues_the_same_global_batches(tmp_path, tiny_model_dir):
    data = _data(tmp_path)
    _, two_steps, two_losses, _ = _run(tmp_path, "two", 2, tiny_model_dir, data, 2)  # global batch 2 x 2 x 2 = 8
    ckpt = str(tmp_path / "two-out" / "checkpoint-3")
    log, resumed_steps, resumed_losses, resumed = _run(tmp_path, "resumed", 1, tiny_model_dir, data, 2,
                                                       "--resume_from_checkpoint", ckpt)
    assert (f"resuming {ckpt} (written at world size 2) at world size 1: gradient accumulation 2 -> 4, so micro batch "
            "2 x gradient accumulation 4 x world size 1 = global batch 8 samples as configured") in log
    assert "different run shape" not in log and "Traceback" not in log
    _, again_steps, again_losses, again = _run(tmp_path, "again", 1, tiny_model_dir, data, 2,
                                               "--resume_from_checkpoint", ckpt)
    _, one_steps, one_losses, one = _run(tmp_path, "one", 1, tiny_model_dir, data, 4)  # uninterrupted, global batch 8

    # determinism: the same checkpoint resumed at the same new world size twice
    assert again_steps == resumed_steps and again_losses == resumed_losses
    assert all(torch.equal(resumed[k], again[k]) for k in resumed)
    # nothing repeated or skipped: each step consumed the uninterrupted run's samples (8 distinct, every sample once
    # per epoch), steps 1-3 at world size 2 and 4-6 at world size 1
    assert sorted(resumed_steps) == [4, 5, 6] and sorted(two_steps) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        consumed = two_steps[s] if s <= 3 else resumed_steps[s]
        assert len(consumed) == 8 and sorted(consumed) == sorted(one_steps[s]), s
    assert len(set(sum((one_steps[s] for s in range(1, 5)), []))) == 32  # epoch 1: all 32 samples, once each
    # the result: the uninterrupted run's, up to the order of floating-point reductions
    assert sorted(resumed_losses) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert abs(resumed_losses[s] - one_losses[s]) <= LOSS_RTOL * abs(one_losses[s]), (s, resumed_losses, one_losses)
    worst = max((resumed[k] - one[k]).abs().max().item() for k in one)
    assert worst <= ADAPTER_ATOL, worst
    assert any(not torch.equal(one[k], load_file(str(tmp_path / "two-out" / "checkpoint-3" /
                                                        "adapter_model.safetensors"))[k]) for k in one)  # it trained


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_zero_resumed_at_another_world_size_through_a_universal_checkpoint(tmp_path, tiny_model_dir, stage):
    data, ds = _data(tmp_path), ["--deepspeed", os.path.join(ROOT, "finetune", f"ds_config_zero{stage}.json")]
    _, two_steps, two_losses, two = _run(tmp_path, "two", 2, tiny_model_dir, data, 2, *ds, steps=4, save_steps=2)
    ckpt = str(tmp_path / "two-out" / "checkpoint-2")
    log, steps, losses, one = _run(tmp_path, "one", 1, tiny_model_dir, data, 2, *ds, "--resume_from_checkpoint", ckpt,
                                   steps=4, save_steps=2)
    assert ("gradient accumulation 2 -> 4, so micro batch 2 x gradient accumulation 4 x world size 1 = global batch 8 "
            "samples as configured; optimizer, scheduler and data position carry over (ZeRO's optimizer state "
            "re-partitioned from the universal checkpoint global_step2_universal)") in log
    assert "Traceback" not in log
    assert sorted(steps) == [3, 4] and all(sorted(steps[s]) == sorted(two_steps[s]) for s in (3, 4))
    assert all(abs(losses[s] - two_losses[s]) <= LOSS_RTOL * abs(two_losses[s]) for s in (3, 4)), (losses, two_losses)
    worst = max((one[k] - two[k]).abs().max().item() for k in two)  # measured 1.5e-8 for both stages
    assert worst <= ADAPTER_ATOL, worst
    moved = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    assert max((two[k] - moved[k]).abs().max().item() for k in two) > 1e-3  # steps 3-4 changed it: a real check
