"""Mixture of experts under every engine (issue 52 items 5 and 6), 2 CPU processes (gloo): a tiny DeepSeek-V3
(tests/helpers/families.py), 3 steps, against one process with the same global batch (gradient accumulation 2).
The default LoRA (attention, dense and shared MLPs, every routed expert through sft.model.expert_lora, router
frozen; dropout 0 so that every run draws the same) under ZeRO-3, FSDP2 and ``--expert_parallel_size 2`` (the
non-expert parameters under DDP): the same losses and the same adapter. Full fine-tuning (experts and router
trained) under ZeRO-3 with gradient checkpointing on: the same losses and the same logits of the trained model.
Cells folded for time (each process start costs ~10-20 s here): LoRA under DDP (gradient checkpointing on) and
ZeRO-2, full fine-tuning under DDP, ZeRO-2 and FSDP2 are not parametrized (each passed when run as a cell of this
module, docs/moe.md). Each micro batch is one short conversation, so rank 0's
tokens reach no token of some expert in every step (read from its routing health, sft/train/routing_health.py), and
every run finishes. Under ZeRO-3 the MoE block is a leaf module, found by structure
(sft.model.experts.mark_zero3_leaf_blocks; DeepSeek-V3's block is not a DeepSpeed default). Under
``--expert_parallel_size 2`` each rank keeps 4 of the 8 routed experts and the tokens travel by all-to-all
(sft.model.expert_parallel); the clip norm (the default --max_grad_norm 1, below every step's norm: it clips) and the
adapter saved (gathered whole) equal one process's too. Trained through tests/helpers/dist_worker.py, as the support
matrix (test_deepspeed.py) trains its cells."""
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

FT = os.path.join(ROOT, "finetune")
STEPS = 3
# DeepSeek-V3 (8 routed experts, top-2, a shared expert; layer 0 dense, layer 1 MoE): its block class is not one of
# the three DeepSpeed 0.19.8 flags as ZeRO-3 leaf modules by default (Mixtral, Qwen2-MoE, Qwen3-MoE)
FAMILY = "deepseek_v3"
COMMON = ["--learning_rate", "1e-2", "--max_steps", str(STEPS), "--per_device_train_batch_size", "1",
          "--lazy_preprocess", "True", "--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--model_max_length",
          "64", "--save_strategy", "no", "--disable_tqdm", "True", "--report_to", "none", "--seed", "0",
          "--logging_steps", "1"]
LORA = ["--use_lora", "True", "--lora_r", "4", "--lora_dropout", "0"]
GC = ["--gradient_checkpointing", "True"]
ZERO3 = ["--deepspeed", os.path.join(FT, "ds_config_zero3.json")]
FSDP2 = ["--fsdp", "--fsdp_config", os.path.join(FT, "fsdp_config_full_shard.json")]
# cell: (processes, flags); "one" / "one-full": the one-process references, accumulating the two ranks' micro batches
ENGINES = {"one": (1, LORA + ["--gradient_accumulation_steps", "2"]),
           "zero3": (2, LORA + ZERO3), "fsdp2": (2, LORA + FSDP2),
           "one-full": (1, ["--gradient_accumulation_steps", "2"]),
           "zero3-full": (2, ZERO3 + GC),
           "ep2": (2, LORA + ["--expert_parallel_size", "2"])}
# fp32; the ranks' gradients reduced vs two micro batches accumulated in one process: another order of additions
RTOL = 1e-4
# the adapters after 3 AdamW steps (lr 1e-2, values up to ~3e-2): AdamW divides each gradient element by its own
# running magnitude, so an element whose gradient is near zero turns rounding into up to a full learning rate (as
# in the support matrix's loss curves, test_deepspeed.py). Measured here: 0 (DDP, not parametrized), 5.9e-7
# (ZeRO-3), 8.7e-5 (FSDP2: the routed experts' lora_B), with the losses equal to 2e-7 relative.
ADAPTER_ATOL = 3e-4
# full fine-tuning: the trained model's logits on the probe after the same 3 AdamW steps of every weight. Measured
# here: 3.2e-6 (ZeRO-3); not parametrized: 2.6e-6 (ZeRO-2), 1.7e-5 (FSDP2), 0 (DDP).
LOGITS_ATOL = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-engines")
    turns = [("hi", "hello"), ("2+2?", "4"), ("red?", "a colour"), ("ok", "fine"), ("cat", "a pet"), ("sun", "hot")]
    data = write_jsonl(tmp / "short.jsonl", [{"id": f"s{i}", "messages": [{"role": "user", "content": u},
                                                                         {"role": "assistant", "content": a}]}
                                             for i, (u, a) in enumerate(turns)])
    model, done = tiny_family_dir(FAMILY), {}

    def run(engine):
        if engine not in done:
            nproc, extra = ENGINES[engine]
            report = tmp / engine
            report.mkdir()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()), os.path.join(ROOT, "tests", "helpers",
                                                                                  "dist_worker.py"),
                   "--model_name_or_path", model, "--data_path", data, "--output_dir", str(report / "out"),
                   "--data_cache_dir", str(report / "cache"), *COMMON, *extra]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp),
                               env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1",
                                                   "SFT_TEST_REPORT_DIR": str(report)}))
            assert r.returncode == 0, f"{engine}: exit {r.returncode}\n{r.stderr[-4000:]}"
            adapter = report / "out" / "adapter_model.safetensors"
            done[engine] = ([json.load(open(report / f"rank{i}.json")) for i in range(nproc)], r.stderr,
                            load_file(str(adapter)) if adapter.exists() else torch.load(report / "logits.pt"))
        return done[engine]

    return run


def _same_run_as_one_process(r0: dict, one: dict, engine: str) -> None:
    """What every cell shares: 2 ranks of the engine, rank 0 saw experts get no token of its micro batch and still
    finished every step (no hang), losses equal to one process's."""
    print(json.dumps({"one": one["losses"], engine: r0["losses"], "idle": r0["moe_idle_experts"]}))
    assert r0["world_size"] == 2
    assert r0["zero_stage"] == (3 if engine.startswith("zero3") else 0)
    assert r0["fsdp2_sharded"] == engine.startswith("fsdp2")
    assert (r0["checkpointed_layers"] > 0) == (engine == "zero3-full"), r0["checkpointed_layers"]
    assert len(r0["losses"]) == STEPS and any(n and n > 0 for n in r0["moe_idle_experts"]), r0["moe_idle_experts"]
    assert r0["losses"] == pytest.approx(one["losses"], rel=RTOL), (r0["losses"], one["losses"])


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_moe_lora_same_losses_and_adapter_as_one_process_no_hang_on_idle_experts(runs, engine):
    (one,), _, one_adapter = runs("one")
    ranks, log, adapter = runs(engine)
    _same_run_as_one_process(ranks[0], one, engine)
    assert "experts down_proj,gate_up_proj" in log and "router frozen (gate)" in log  # expert LoRA, not peft's
    # the adapter after 3 steps (every expert's LoRA factors included) equals the one-process one
    assert sorted(adapter) == sorted(one_adapter) and any(".experts." in k for k in adapter)
    assert all(one_adapter[k].abs().sum() > 0 for k in one_adapter if "lora_B" in k)  # trained: it can fail
    diff = {k: float((adapter[k] - v).abs().max()) for k, v in one_adapter.items()}
    print(json.dumps({"worst": max(diff.items(), key=lambda kv: kv[1])}))
    for k, v in one_adapter.items():
        torch.testing.assert_close(adapter[k], v, rtol=RTOL, atol=ADAPTER_ATOL, msg=f"{k}: {diff[k]:.3g}")
    if engine == "zero3":  # the MoE layer's block, found by structure: not one of DeepSpeed's default leaf classes
        assert ranks[0]["zero3_leaf_blocks"] == 1
        assert "ZeRO-3: 1 mixture-of-experts blocks are leaf modules (DeepseekV3MoE)" in log


@pytest.mark.parametrize("engine", ["zero3-full"])
def test_moe_full_fine_tuning_same_losses_and_model_as_one_process(runs, engine):
    (one,), _, one_logits = runs("one-full")
    ranks, log, logits = runs(engine)
    _same_run_as_one_process(ranks[0], one, engine)
    assert "LoRA r=" not in log
    # the trained model (experts and router included) gives the one-process model's logits on the probe
    print(json.dumps({"logits": float((logits - one_logits).abs().max())}))
    torch.testing.assert_close(logits, one_logits, rtol=RTOL, atol=LOGITS_ATOL)
    if engine == "zero3-full":
        assert ranks[0]["zero3_leaf_blocks"] == 1


def test_expert_parallel_lora_equals_one_process(runs):
    (one,), _, one_adapter = runs("one")
    ranks, log, adapter = runs("ep2")
    norms = [r["grad_norms"] for r in ranks]
    print(json.dumps({"one": [one["losses"], one["grad_norms"]], "ep2": [ranks[0]["losses"], norms[0]]}))
    assert "expert parallelism: 2 ranks per group" in log and "4 of 8 routed experts per layer" in log
    assert len(ranks[0]["losses"]) == STEPS
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=RTOL), (ranks[0]["losses"], one["losses"])
    # the norm clipped by is the whole model's (every expert once), on both ranks, and above the limit (1): it clips
    assert norms[0] == pytest.approx(one["grad_norms"], rel=RTOL) and norms[1] == pytest.approx(norms[0], rel=RTOL)
    assert min(one["grad_norms"]) > 1, one["grad_norms"]
    # the adapter saved is the whole one: every expert's LoRA factors, in peft's shapes, equal to one process's
    assert sorted(adapter) == sorted(one_adapter) and all(adapter[k].shape == v.shape for k, v in one_adapter.items())
    diff = {k: float((adapter[k] - v).abs().max()) for k, v in one_adapter.items()}
    print(json.dumps({"worst": max(diff.items(), key=lambda kv: kv[1])}))
    for k, v in one_adapter.items():
        torch.testing.assert_close(adapter[k], v, rtol=RTOL, atol=ADAPTER_ATOL, msg=f"{k}: {diff[k]:.3g}")


def test_expert_parallel_exchange_equals_the_whole_module(tmp_path):
    """One experts module cut over 2 ranks (tests/helpers/ep_worker.py): outputs and gradients equal the whole
    module's, gpt-oss's expert biases included; routing every token to rank 0's experts leaves rank 1 without a row,
    and both ranks finish."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(ROOT, "tests", "helpers", "ep_worker.py"), "qwen3_moe",
           "gpt_oss"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                       env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1", "SFT_TEST_REPORT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    print(json.dumps(ranks))
    for report in ranks:
        assert sorted(report) == ["gpt_oss", "qwen3_moe"]
        for family, cases in report.items():
            for case, d in cases.items():
                assert max(d.values()) < 1e-5, (family, case, d)
