"""The support matrix, run for real on CPU: every preset under torchrun (2 processes, gloo) with a tiny
Qwen2 model and the real Qwen vocabulary.

Each cell trains with a cosine schedule, saves, and its saved output is reloaded here and must give the
trained model's logits. Full fine-tuning with one seed gives one loss curve under DDP, ZeRO-2 and ZeRO-3, and
under FSDP2 (tolerances below).
The DeepSpeed/Q-LoRA settings checks that stop before loading (in process) are in tests/unit/config/test_deepspeed.py.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.data import TOY, write_jsonl
from tests.helpers.launchers import without_check
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port

FT = os.path.join(ROOT, "finetune")
ZERO2, ZERO3 = os.path.join(FT, "ds_config_zero2.json"), os.path.join(FT, "ds_config_zero3.json")
ZERO3_OFFLOAD = os.path.join(FT, "ds_config_zero3_offload.json")
STEPS = 6
COMMON = ["--max_steps", str(STEPS), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
          "--save_strategy", "no", "--lr_scheduler_type", "cosine", "--warmup_ratio", "0", "--model_max_length", "64",
          "--disable_tqdm", "True", "--report_to", "none", "--seed", "0", "--logging_steps", "1"]
FULL = ["--learning_rate", "1e-3"]
LORA = ["--learning_rate", "1e-2", "--lora_r", "4"]

# cell: (preset script, processes, flags after the preset's)
# full-ddp and its full-head twin read the data lazily, as the full_ds / full_fsdp presets do (Qwen's --lazy_preprocess
# True): then all four full fine-tuning cells draw the same micro batches (the eager default forms padding-free micro
# batches under a token budget, largest first, which a lazy dataset, without lengths up front, cannot)
LAZY = ["--lazy_preprocess", "True"]
CELLS = {
    "full-ddp": ("launch.sh", 2, FULL + LAZY),
    "full-zero2": ("finetune_ds.sh", 2, FULL + ["--deepspeed", ZERO2]),
    "full-zero3": ("finetune_ds.sh", 2, FULL),
    # the LM head at every position (transformers' own loss): the reference of the supervised-only default
    "full-ddp-full-head": ("launch.sh", 2, FULL + LAZY + ["--lm_head_supervised_only", "False"]),
    "lora-ddp": ("finetune_lora_single_gpu.sh", 2, LORA),
    "lora-zero2": ("finetune_lora_ds.sh", 2, LORA),
    "lora-zero2-full-head": ("finetune_lora_ds.sh", 2, LORA + ["--lm_head_supervised_only", "False"]),
    "lora-zero3-offload": ("finetune_lora_ds.sh", 2, LORA + ["--deepspeed", ZERO3_OFFLOAD]),
    # a base model whose chat tokens are untrained: embeddings + lm_head are trained with the adapter
    "lora-zero3-new-chat-tokens": ("finetune_lora_ds.sh", 2, LORA + ["--deepspeed", ZERO3]),
    "qlora-single": ("finetune_qlora_single_gpu.sh", 1, LORA),
    "qlora-ddp": ("finetune_qlora_single_gpu.sh", 2, LORA),
    "qlora-zero2": ("finetune_qlora_ds.sh", 2, LORA),
    # pre-quantized bases, loaded as saved (never quantized again): the seed's
    # `finetune_qlora_ds.sh -m Qwen/Qwen-7B-Chat-Int4` on a GPTQ folder (ZeRO-2), the same under DDP, and a
    # bitsandbytes 4-bit base written by save_pretrained
    "gptq-zero2": ("finetune_qlora_ds.sh", 2, LORA),
    "gptq-ddp": ("finetune_qlora_single_gpu.sh", 2, LORA),
    "bnb4-saved-single": ("finetune_qlora_single_gpu.sh", 1, LORA),
    "full-fsdp2": ("finetune_fsdp.sh", 2, FULL),
    "lora-fsdp2": ("finetune_lora_fsdp.sh", 2, LORA),
}
# the one cell launched with the launcher's sft check (flags and every record checked in one process before torchrun;
# the training processes validate the same flags again): the others start without it (tests/helpers/launchers.py)
CHECKED = "lora-zero2"
# the linear module class each kind of 4-bit base trains on (gptqmodel's torch kernel for GPTQ on CPU)
QUANT_LINEAR = {"qlora": "Linear4bit", "bnb4": "Linear4bit", "gptq": "TorchLinear"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """32 distinct conversations: TOY four times, each copy's first turn tagged with its copy number."""
    records = []
    for copy in range(4):
        for r in json.loads(json.dumps(TOY)):
            turns = r.get("conversations") or r.get("messages")
            key = "value" if "conversations" in r else "content"
            first = next(t for t in turns if t.get("from", t.get("role")) in ("human", "user"))
            first[key] += f" (copy {copy})"
            r["id"] = f"{r['id']}-{copy}"
            records.append(r)
    return write_jsonl(tmp_path_factory.mktemp("ds-data") / "toy.jsonl", records)


def model_dir(cell):
    from tests.helpers import assets

    if cell.startswith("gptq"):
        return assets.tiny_gptq_dir()
    if cell.startswith("bnb4"):
        return assets.tiny_bnb4_dir()
    return assets.tiny_qwen2_dir(zero_chat_rows=cell.endswith("new-chat-tokens"))


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """Run a cell once per module (a cell's result is used by several tests)."""
    done = {}

    def run(cell):
        if cell not in done:
            script, nproc, flags = CELLS[cell]
            tmp = tmp_path_factory.mktemp(cell)
            report, out = tmp / "report", tmp / "out"
            report.mkdir()
            env = pythonpath_env({**os.environ, "NPROC_PER_NODE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
                                  "PYTHON": sys.executable if cell == CHECKED else without_check(tmp),
                                  "SFT_PROGRAM": os.path.join(ROOT, "tests", "helpers", "dist_worker.py"),
                                  "SFT_TEST_REPORT_DIR": str(report)})
            env.pop("GPUS_PER_NODE", None)
            cmd = ["bash", os.path.join(FT, script), "-m", model_dir(cell), "-d", data, "--output_dir", str(out),
                   *COMMON, *flags]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp))
            assert r.returncode == 0, f"{cell}: exit {r.returncode}\n{r.stderr[-4000:]}"
            ranks = [json.load(open(report / f"rank{i}.json")) for i in range(nproc)]
            done[cell] = {"ranks": ranks, "out": str(out), "logits": torch.load(report / "logits.pt"),
                          "stderr": r.stderr}
        return done[cell]

    return run


def reload(cell, out, base_dir):
    """The saved output, loaded as a user would: a full model folder, or base model + adapter."""
    import transformers
    from peft import PeftModel

    if cell.startswith("full"):
        return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    extra = {}
    # gptqmodel's torch kernel, as sft trains with on CPU (sft.model.loading.pre_quantized_kwargs)
    if cell.startswith("gptq"):
        config = transformers.AutoConfig.from_pretrained(base_dir)
        config.quantization_config = {**config.quantization_config, "backend": "torch"}
        extra = {"config": config, "device_map": {"": "cpu"}}
    elif cell.startswith("bnb4"):  # quantized as saved
        extra = {"device_map": {"": "cpu"}}
    elif cell.startswith("qlora"):
        extra = {"quantization_config": transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32), "device_map": {"": "cpu"}}
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, **extra)
    return PeftModel.from_pretrained(base, out)


@pytest.mark.parametrize("cell", list(CELLS))
def test_cell_trains_follows_cosine_saves_and_reloads_equal(cell, runs, qwen_tok):
    res = runs(cell)
    r0 = res["ranks"][0]
    _, nproc, flags = CELLS[cell]
    assert ("check: configuration and data OK" in res["stderr"]) == (cell == CHECKED)  # the check ran end to end
    assert r0["world_size"] == nproc
    expect_stage = 2 if "zero2" in cell else 3 if "zero3" in cell else 0
    assert r0["deepspeed"] == (expect_stage > 0) and r0["zero_stage"] == expect_stage
    kind = cell.split("-")[0]
    assert (QUANT_LINEAR.get(kind) in r0["linear_kinds"]) if kind in QUANT_LINEAR else not (
        {"Linear4bit", "TorchLinear"} & set(r0["linear_kinds"])), r0["linear_kinds"]
    # FSDP2: accelerate kept the plugin (sft.compat.accelerate on CPU) and fully_shard left DTensor shards
    assert r0["fsdp"] == r0["fsdp2_sharded"] == ("fsdp2" in cell)
    # trains: the loss goes down over 6 steps (first step vs mean of the last two)
    losses = r0["losses"]
    assert len(losses) == STEPS and sum(losses[-2:]) / 2 < losses[0], losses
    # cosine, not a DeepSpeed scheduler: the LR logged after optimizer step s is lr * (1 + cos(pi (s-1) / T)) / 2
    lr = float(flags[flags.index("--learning_rate") + 1])
    want = [lr * 0.5 * (1 + math.cos(math.pi * s / STEPS)) for s in range(STEPS)]
    assert r0["learning_rates"] == pytest.approx(want, rel=1e-6)
    # the saved output reloads and gives the trained model's logits
    tok, _ = qwen_tok
    from tests.helpers.dist_worker import PROBE

    model = reload(cell, res["out"], model_dir(cell)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok(PROBE)["input_ids"]])).logits.float()
    torch.testing.assert_close(logits, res["logits"], rtol=1e-5, atol=1e-5)
    if not cell.startswith("full"):
        new_tokens = cell.endswith("new-chat-tokens")
        # decided from the gathered embedding rows, also under ZeRO-3 (where a rank holds a shard only)
        assert (f"train embeddings: {new_tokens} (auto: "
                + ("embedding rows of" if new_tokens else "chat tokens")) in res["stderr"], res["stderr"][-3000:]
        from safetensors.torch import load_file

        adapter = load_file(os.path.join(res["out"], "adapter_model.safetensors"))
        lora_b = [v for k, v in adapter.items() if "lora_B" in k]
        assert lora_b and all(v.abs().sum() > 0 for v in lora_b), "adapter empty or untrained"
        assert not any("base_layer" in k for k in adapter), "base weights leaked into the adapter file"


def test_full_fine_tuning_same_loss_curve_under_ddp_zero2_zero3(runs):
    """Same seed, same global batch: the first step's loss is equal to 1e-6 relative and the curve stays
    within 2e-3 relative over 6 steps. Not bit-equal: DDP all-reduces gradients in buckets while ZeRO
    reduce-scatters flat partitions, so the fp32 sums run in a different order (~1e-7 relative); Adam
    divides each gradient element by its own running magnitude, so an element near zero whose rounding
    differs moves its weight by up to a full learning rate, and the difference grows step by step
    (measured here: 3e-6 relative at step 2, 5e-4 at step 6)."""
    curves = {c: runs(c)["ranks"][0]["losses"] for c in ("full-ddp", "full-zero2", "full-zero3")}
    print(json.dumps(curves))
    for c in ("full-zero2", "full-zero3"):
        assert curves[c][0] == pytest.approx(curves["full-ddp"][0], rel=1e-6), curves
        assert curves[c] == pytest.approx(curves["full-ddp"], rel=2e-3), curves
    seen = [set(r["seen"]) for r in runs("full-zero3")["ranks"]]
    assert not seen[0] & seen[1], "ZeRO-3 ranks trained on the same samples"


@pytest.mark.parametrize("cell,reference", [("full-ddp", "full-ddp-full-head"), ("full-zero2", "full-ddp-full-head"),
                                            ("full-zero3", "full-ddp-full-head"),
                                            ("lora-zero2", "lora-zero2-full-head")])
def test_supervised_only_lm_head_same_loss_curve_as_the_full_head(runs, cell, reference):
    """The default (--lm_head_supervised_only True, sft/model/loss.py; tied embeddings, the real Qwen vocabulary)
    against logits at every position: the first step's loss equal to 1e-6 relative and the 6-step curve within 2e-3 (the
    sums run in another order; Adam amplifies it, as in the DDP / ZeRO comparison above)."""
    ours, ref = runs(cell)["ranks"][0]["losses"], runs(reference)["ranks"][0]["losses"]
    print(json.dumps({cell: ours, reference: ref}))
    assert len(ours) == len(ref) == STEPS
    assert ours[0] == pytest.approx(ref[0], rel=1e-6) and ours == pytest.approx(ref, rel=2e-3)
    assert "LM head and loss: at supervised positions only" in runs(cell)["stderr"]
    assert "LM head and loss" not in runs(reference)["stderr"]


def test_adapter_on_gptq_base_merges_only_into_the_16bit_base(runs, tmp_path, qwen_tok):
    """sft-merge of the seed's GPTQ run: refused (exit 2, the reason, nothing written) with the recorded
    GPTQ base; with --base the 16-bit model it was quantized from, a plain 16-bit model folder whose logits
    are those of that base with the adapter (merge = the adapter applied, not a re-quantization)."""
    import transformers
    from peft import PeftModel

    from sft.cli import merge_main
    from tests.helpers import assets
    from tests.helpers.dist_worker import PROBE

    adapter = runs("gptq-zero2")["out"]
    r = subprocess.run([sys.executable, "-m", "sft", "merge", adapter, str(tmp_path / "refused")],
                       capture_output=True, text=True, timeout=300, env=pythonpath_env())
    assert r.returncode == 2 and "is a pre-quantized GPTQ 4-bit model" in r.stderr, r.stderr[-2000:]
    assert "pass --base with the 16-bit model" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "refused").exists()
    base16 = assets.tiny_qwen2_dir()
    assert merge_main([adapter, str(tmp_path / "merged"), "--base", base16]) == 0
    merged_cfg = json.load(open(tmp_path / "merged" / "config.json"))
    assert "quantization_config" not in merged_cfg
    tok, _ = qwen_tok
    ids = torch.tensor([tok(PROBE)["input_ids"]])
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    on_16bit = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        base16, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, on_16bit(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
def test_full_fine_tuning_fsdp2_same_loss_curve_as_ddp(runs):
    """Same seed, same global batch, FSDP2 full shard against DDP (AdamW, --max_grad_norm 1): equal at the first
    step (1e-6 relative), within 2e-3 relative over 6 steps, the tolerance of ZeRO against DDP (measured here:
    5e-6 at step 2, 6e-4 at step 6). Plain SGD differs more (docs/fsdp.md, "Loss curve against DDP")."""
    curves = {c: runs(c)["ranks"][0]["losses"] for c in ("full-ddp", "full-fsdp2")}
    print(json.dumps(curves))
    assert curves["full-fsdp2"][0] == pytest.approx(curves["full-ddp"][0], rel=1e-6), curves
    assert curves["full-fsdp2"] == pytest.approx(curves["full-ddp"], rel=2e-3), curves
    seen = [set(r["seen"]) for r in runs("full-fsdp2")["ranks"]]
    assert not seen[0] & seen[1], "FSDP2 ranks trained on the same samples"


def test_qlora_preset_refuses_zero3_in_seconds_before_loading(tiny_model_dir, tmp_path):
    """The refused combination through the preset: exit 2, the reason, no model loaded, nothing written."""
    env = {**os.environ, "PYTHON": sys.executable, "NPROC_PER_NODE": "1"}
    env.pop("GPUS_PER_NODE", None)
    data = write_jsonl(tmp_path / "toy.jsonl", TOY)
    r = subprocess.run(["bash", os.path.join(FT, "finetune_qlora_ds.sh"), "-m", tiny_model_dir, "-d", data,
                        "--output_dir", str(tmp_path / "out"), "--deepspeed", ZERO3],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    from sft.config.deepspeed import EXAMPLE  # the shipped ZeRO-2 config (package data; finetune/ links to it)

    assert f"use ZeRO-2 (--deepspeed {EXAMPLE}" in r.stderr and "Traceback" not in r.stderr
    assert "LoRA r=" not in r.stderr  # the model was never loaded
    assert not (tmp_path / "out").exists()


def test_presets_pass_bash_n_and_print_help():
    for name in ("finetune_ds.sh", "finetune_lora_ds.sh", "finetune_qlora_ds.sh", "finetune_lora_single_gpu.sh",
                 "finetune_qlora_single_gpu.sh", "presets.sh", "launch.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(FT, name)]).returncode == 0, name
    r = subprocess.run(["bash", os.path.join(FT, "finetune_qlora_ds.sh"), "-h"], capture_output=True, text=True)
    assert r.returncode == 0 and "--q_lora True --deepspeed" in r.stdout and "NNODES" in r.stdout
