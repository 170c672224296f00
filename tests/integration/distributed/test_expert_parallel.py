"""Experts spread across ranks (issue 52 item 6): ``--expert_parallel_size 2`` on 2 CPU processes (gloo), a tiny
Qwen3-MoE (8 experts, top-2; tests/helpers/families.py) with the default LoRA (dropout 0), 3 steps, against one
process with the same global batch (gradient accumulation 2): each rank keeps 4 experts, tokens travel by
all-to-all, DDP averages the rest and the expert LoRA's gradients are scaled as one process's; the losses, the saved
adapter (gathered whole: every expert's factors) and the gradient clipping (a low ``--max_grad_norm`` that clips every
step, over every rank's experts) equal the one-process run. Trained through tests/helpers/dist_worker.py."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.data import write_jsonl
from tests.helpers.families import tiny_family_dir
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port

STEPS = 3
FAMILY = "qwen3_moe"
FLAGS = ["--use_lora", "True", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "1e-2",
         "--max_steps", str(STEPS), "--per_device_train_batch_size", "1", "--lazy_preprocess", "True",
         "--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--model_max_length", "64", "--save_strategy", "no",
         "--disable_tqdm", "True", "--report_to", "none", "--seed", "0", "--logging_steps", "1",
         "--max_grad_norm", "0.05"]  # below every step's norm: the clip acts at each step
RUNS = {"one": (1, ["--gradient_accumulation_steps", "2"]), "ep2": (2, ["--expert_parallel_size", "2"])}
RTOL = 1e-4  # fp32; the same sums in another order (as tests/integration/distributed/test_moe_engines.py)
ADAPTER_ATOL = 3e-4  # AdamW turns rounding of a near-zero gradient into up to a learning rate (test_moe_engines.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("expert-parallel")
    turns = [("hi", "hello"), ("2+2?", "4"), ("red?", "a colour"), ("ok", "fine"), ("cat", "a pet"), ("sun", "hot")]
    data = write_jsonl(tmp / "short.jsonl", [{"id": f"s{i}", "messages": [{"role": "user", "content": u},
                                                                         {"role": "assistant", "content": a}]}
                                             for i, (u, a) in enumerate(turns)])
    model, done = tiny_family_dir(FAMILY), {}

    def run(name):
        if name not in done:
            nproc, extra = RUNS[name]
            report = tmp / name
            report.mkdir()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()),
                   os.path.join(ROOT, "tests", "helpers", "dist_worker.py"), "--model_name_or_path", model,
                   "--data_path", data, "--output_dir", str(report / "out"), "--data_cache_dir", str(report / "cache"),
                   *FLAGS, *extra]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp),
                               env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1",
                                                   "SFT_TEST_REPORT_DIR": str(report)}))
            assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stderr[-4000:]}"
            done[name] = ([json.load(open(report / f"rank{i}.json")) for i in range(nproc)], r.stderr,
                          load_file(str(report / "out" / "adapter_model.safetensors")))
        return done[name]

    return run


def test_expert_parallel_lora_equals_one_process(runs):
    (one,), _, one_adapter = runs("one")
    ranks, log, adapter = runs("ep2")
    print(json.dumps({"one": one["losses"], "ep2": ranks[0]["losses"], "norms": [one["grad_norms"],
                                                                                 ranks[0]["grad_norms"]]}))
    assert "expert parallelism: 2 ranks per group" in log and "4 of 8 routed experts per layer" in log
    assert len(ranks[0]["losses"]) == STEPS
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=RTOL), (ranks[0]["losses"], one["losses"])
    # the norm clipped by is the whole model's (every expert once), the same on both ranks, and above the limit
    norms = [r["grad_norms"] for r in ranks]
    assert norms[0] == pytest.approx(one["grad_norms"], rel=RTOL) and norms[1] == pytest.approx(norms[0], rel=RTOL)
    assert min(one["grad_norms"]) > 0.05, one["grad_norms"]
    # the adapter saved is the whole one: every expert's LoRA factors, in peft's shapes, equal to one process's
    assert sorted(adapter) == sorted(one_adapter) and any(".experts." in k for k in adapter)
    assert all(adapter[k].shape == v.shape for k, v in one_adapter.items())
    assert all(one_adapter[k].abs().sum() > 0 for k in one_adapter if "lora_B" in k)  # trained: it can fail
    diff = {k: float((adapter[k] - v).abs().max()) for k, v in one_adapter.items()}
    print(json.dumps({"worst": max(diff.items(), key=lambda kv: kv[1])}))
    for k, v in one_adapter.items():
        torch.testing.assert_close(adapter[k], v, rtol=RTOL, atol=ADAPTER_ATOL, msg=f"{k}: {diff[k]:.3g}")
