"""Sequence parallelism is exact: two processes holding half of every row each (``--sequence_parallel_size 2``) train
the same model as one process holding the whole row -- the same losses, gradient norms and weights within fp32
tolerance over 3 optimizer steps, on rows of several documents (padding-free and packed), with LoRA, full
fine-tuning under ZeRO-2 and FSDP2, both attentions (Ulysses, all-gather) and gradient checkpointing; and the
evaluation loss.

Each run costs ~15-30 s on 2 cores (tests/helpers/sp_worker.py under torchrun); the N = 1 references run once per
layout (module fixtures), in this process (``record``: three trainings without three interpreters' imports)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port

WORKER = os.path.join(ROOT, "tests", "helpers", "sp_worker.py")
LORA = ["--use_lora", "True", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "1e-2"]  # no dropout: the
FULL = ["--use_lora", "False", "--learning_rate", "1e-4"]  # same masks cannot be drawn by one process and by two
PACKED = ["--packing", "True", "--model_max_length", "160", "--per_device_train_batch_size", "2"]
LONG_TOKENS, CGROUP_GIB = 800, 2.0  # one process holds 800 tokens: refused at 2 GiB; 400 each: trains
EVAL = ["--eval_split_ratio", "0.25", "--eval_strategy", "steps", "--eval_steps", "3"]  # 2 of the 8 records


def train(tmp, model_dir, data, nproc: int, sp: int, extra: list) -> dict:
    report = tmp / "report"
    report.mkdir(parents=True)
    args = ["--model_name_or_path", model_dir, "--data_path", data, "--output_dir", str(tmp / "out"),
            "--per_device_train_batch_size", "4", "--max_steps", "3", "--report_to", "none", "--save_strategy", "no",
            "--logging_steps", "1", "--disable_tqdm", "True", "--bf16", "False", "--seed", "1",
            "--sequence_parallel_size", str(sp), *extra]
    if nproc == 1:  # the N = 1 reference: trained in this process (the same Trainer; no interpreter of its own)
        from tests.helpers.sp_worker import record

        record(args, str(report))
        log = ""
    else:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), WORKER, *args],
                           capture_output=True, text=True, timeout=300,
                           env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1",
                                               "SFT_TEST_REPORT_DIR": str(report)}))
        assert r.returncode == 0, r.stderr[-4000:]
        log = r.stderr
    ranks = [json.load(open(report / f"rank{i}.json")) for i in range(nproc)]
    return {"ranks": ranks, "weights": torch.load(report / "weights.pt"), "log": log}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return str(write_jsonl(tmp_path_factory.mktemp("sp-data") / "toy.jsonl", TOY))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, toy):
    """One process, N = 1: LoRA padding-free, LoRA packed, full padding-free."""
    runs = {}
    for name, extra in (("lora", LORA + EVAL), ("packed", LORA + PACKED), ("full", FULL)):
        runs[name] = train(tmp_path_factory.mktemp(f"sp-ref-{name}"), tiny_model_dir, toy, 1, 1, extra)
    return runs


def assert_same(ref: dict, got: dict) -> None:
    """Every rank of the N = 2 run logged the reference's losses and gradient norms, and ended with its weights."""
    for rank in got["ranks"]:
        assert rank["losses"] == pytest.approx(ref["ranks"][0]["losses"], rel=1e-5)
        assert rank["grad_norms"] == pytest.approx(ref["ranks"][0]["grad_norms"], rel=1e-4)
        assert rank["eval_loss"] == pytest.approx(ref["ranks"][0]["eval_loss"], rel=1e-5)
    assert sorted(got["weights"]) == sorted(ref["weights"])
    worst = max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
    assert worst < 1e-4, f"weights differ by up to {worst}"


@pytest.mark.parametrize("layout, mode, extra", [
    ("lora", "ulysses", []),
    ("packed", "all_gather", ["--gradient_checkpointing", "True"]),
    ("full", "ulysses", ["--deepspeed", os.path.join(ROOT, "finetune", "ds_config_zero2.json")]),
    ("full", "all_gather", ["--fsdp", "full_shard", "--fsdp_config",
                            os.path.join(ROOT, "finetune", "fsdp_config_full_shard.json")]),
])
def test_two_ranks_per_row_train_as_one_process(reference, tmp_path, tiny_model_dir, toy, layout, mode, extra):
    base = {"lora": LORA + EVAL, "packed": LORA + PACKED, "full": FULL}[layout]
    got = train(tmp_path, tiny_model_dir, toy, 2, 2, base + ["--sequence_parallel_mode", mode] + extra)
    assert_same(reference[layout], got)
    assert {r["attention"] for r in got["ranks"]} == {f"sft_sp_{mode}_sdpa"}
    # each rank held half of every row (rows padded to an even length), the same micro batches on both
    whole = reference[layout]["ranks"][0]["row_tokens"]
    halves = got["ranks"][0]["row_tokens"]
    assert got["ranks"][1]["row_tokens"] == halves
    if layout != "packed":  # one row per micro batch in both runs (packed rows are flattened under N = 2)
        assert halves == [-(-n // 2) for n in whole]
    assert "data-parallel size 1 (world size 2 / sequence-parallel size 2)" in got["log"]


def test_a_conversation_one_process_cannot_hold_trains_on_two(tmp_path, tiny_model_dir):
    """Two processes, each its own torchrun node in a memory cgroup of its own capped at the same size (as if each had
    a device of that size; tests/helpers/cgroups.py, root). Data parallel (N = 1, each process holding whole
    conversations) is refused before step 1 by the memory plan on both, which names ``--sequence_parallel_size 2``;
    with it the same two processes train. The conversations are one long reply each, every token supervised, so the
    LM head at supervised positions (12.5 bytes per logit of the Qwen vocabulary's 151,646) is what grows with
    the length a process holds."""
    from tests.helpers.cgroups import run_in_memory_cgroups

    reply = " ".join(f"step {i} is fine" for i in range(400))
    data = write_jsonl(tmp_path / "long.jsonl", [{"id": f"long-reply-{i}", "messages": [
        {"role": "user", "content": "Count."}, {"role": "assistant", "content": reply}]} for i in range(2)])
    env = pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1"})

    def two_nodes(sp: int) -> tuple[int, str]:
        port = str(free_port())
        args = ["--model_name_or_path", tiny_model_dir, "--data_path", data, "--model_max_length", str(LONG_TOKENS),
                "--long_conversations", "truncate", "--per_device_train_batch_size", "1", "--max_steps", "1",
                "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "True",
                "--bf16", "False", "--use_lora", "True", "--lora_r", "4", "--lora_dropout", "0",
                "--output_dir", str(tmp_path / f"sp{sp}"), "--sequence_parallel_size", str(sp)]
        return run_in_memory_cgroups([[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                                       str(i), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port",
                                       port, os.path.join(ROOT, "finetune.py"), *args] for i in range(2)],
                                     int(CGROUP_GIB * 2 ** 30), env, ROOT)

    try:
        rc, log = two_nodes(1)
    except OSError as e:
        pytest.skip(f"no memory cgroup can be made here ({e}): needs root and a cgroup file system")
    refusal = [ln for ln in log.splitlines() if "does not fit in memory" in ln]
    assert rc != 0 and refusal, log[-3000:]  # each rank exits 2; torchrun reports a failed child with 1
    assert "--sequence_parallel_size 2" in refusal[0], refusal[0]
    rc, log = two_nodes(2)
    assert rc == 0, log[-4000:]
    assert f"{LONG_TOKENS} tokens in the largest micro batch / 2 sequence-parallel ranks" in log
    assert "step 1/1" in log
