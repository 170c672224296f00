"""sft-export (issue 44 item 3) on the tiny model: a ZeRO-3 checkpoint of a real 2-process run becomes a model folder
that ``AutoModelForCausalLM.from_pretrained`` loads with the logits of an independent reference (the run's own final
save); a full and a LoRA checkpoint (copied, and merged); and the refusals: a damaged or unmarked checkpoint by name, a
non-empty OUT without --overwrite, --merge without an adapter. An FSDP2 sharded (torch.distributed.checkpoint)
checkpoint of 2 processes, exported to the run's final model bit for bit, is in the FSDP2 kill -9 test
(tests/integration/distributed/test_fsdp.py), which writes one anyway."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from sft.cli import export_main
from sft.train.checkpoint import mark_complete
from tests.helpers.data import write_jsonl
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port

IDS = torch.tensor([[9707, 0, 3555, 374, 220, 17, 488, 220, 18, 30, 151645, 198]])  # "Hello! What is 2 + 3?" ...


def _logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _torchrun(args, env_extra=None, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}))
    assert r.returncode == 0, r.stderr[-4000:]


def _export(*argv) -> subprocess.CompletedProcess:
    """``python -m sft export ...`` as a user runs it (the console script sft-export is the same function)."""
    return subprocess.run([sys.executable, "-m", "sft", "export", *map(str, argv)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=pythonpath_env())


def _diff_line(stdout: str) -> float:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("verified: reloaded"))
    return float(line.split("by at most ")[1].split(" ")[0])


def test_zero3_checkpoint_exports_to_a_model_folder_with_the_runs_logits(tmp_path, tiny_model_dir):
    """Full fine-tuning under ZeRO-3 (2 processes, gloo), 2 steps, a checkpoint at step 2: exported from the ZeRO
    shards (fp32 master weights, through DeepSpeed's zero_to_fp32) into 2 safetensors shards, it gives the logits of the
    run's own final model (saved by the Trainer after the same step) within 1e-5, and not those of the base."""
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"item {i}: what comes after {i}?"},
                                             {"role": "assistant", "content": f"{i + 1} comes after {i}."}]}
               for i in range(16)]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    run = tmp_path / "run"
    report = tmp_path / "report"
    report.mkdir()
    _torchrun([os.path.join(ROOT, "tests", "helpers", "step_worker.py"), "--model_name_or_path", tiny_model_dir,
               "--data_path", data, "--output_dir", str(run), "--data_cache_dir", str(tmp_path / "cache"),
               "--deepspeed", os.path.join(ROOT, "finetune", "ds_config_zero3.json"), "--learning_rate", "1e-3",
               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_steps", "2",
               "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none", "--disable_tqdm", "True",
               "--seed", "7"], {"SFT_TEST_REPORT_DIR": str(report)})
    ckpt = run / "checkpoint-2"
    assert any(n.endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt") for n in os.listdir(ckpt / "global_step2"))
    r = _export(ckpt, tmp_path / "exported", "--max_shard_size", "20MB")
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    assert "DeepSpeed ZeRO shards: global_step2/, written by 2 ranks" in r.stdout
    assert _diff_line(r.stdout) <= 1e-5
    out = tmp_path / "exported"
    names = set(os.listdir(out))
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
            "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= names, names
    assert not names & {"model.safetensors", "trainer_state.json", "latest", "global_step2"}
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert json.load(open(out / "config.json"))["use_cache"] is True
    got, want = _logits(out), _logits(run)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - _logits(tiny_model_dir)).abs().max() > 1e-3  # the 2 steps moved the logits: the check can fail


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory, tiny_model_dir):
    """A complete checkpoint-N folder of a full model (as DDP or FSDP2 with FULL_STATE_DICT save it), marked."""
    path = tmp_path_factory.mktemp("full") / "checkpoint-3"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    (path / "trainer_state.json").write_text("{}")
    mark_complete(str(path), {"world_size": 1})
    return path


def test_full_checkpoint_exports_and_refusals(full_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert export_main([str(full_checkpoint), str(out), "--dtype", "bfloat16"]) == 0
    stdout = capsys.readouterr().out
    assert "(a full model: model*.safetensors)" in stdout and _diff_line(stdout) <= 1e-5
    assert json.load(open(out / "config.json"))["dtype"] == "bfloat16"
    want = _logits(full_checkpoint)
    assert (_logits(out) - want).abs().max() < 0.05  # bf16 rounding of the weights, no more
    # OUT not empty: refused without --overwrite; with it, replaced (a model folder only)
    assert export_main([str(full_checkpoint), str(out)]) == 2
    assert f"{out}: not empty; choose another folder or pass --overwrite" in capsys.readouterr().err
    assert export_main([str(full_checkpoint), str(out), "--overwrite"]) == 0
    torch.testing.assert_close(_logits(out), want, rtol=0, atol=1e-5)
    assert json.load(open(out / "config.json"))["dtype"] == "float32"  # auto: the checkpoint's
    (out / "notes.txt").write_text("mine")
    assert export_main([str(full_checkpoint), str(out), "--overwrite"]) == 2
    assert "also holds notes.txt" in capsys.readouterr().err and (out / "notes.txt").exists()
    # --merge needs an adapter
    assert export_main([str(full_checkpoint), str(tmp_path / "m"), "--merge"]) == 2
    assert "holds a full model, not a LoRA adapter" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_damaged_or_unmarked_checkpoint_refused_by_name(full_checkpoint, tmp_path, capsys):
    """A flipped byte in the weights and a checkpoint without its marker: exit 2, one line naming the checkpoint and
    the file, no traceback, nothing written."""
    bad = _copy(full_checkpoint, tmp_path / "checkpoint-3")
    with open(bad / "model.safetensors", "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert export_main([str(bad), str(tmp_path / "out")]) == 2  # run_cli: the policy of every command
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: {bad}: not a complete, intact checkpoint: model.safetensors: its xxh3_128 "
                                "checksum differs"), errors[0]
    os.remove(bad / "sft_checkpoint_complete.json")
    assert export_main([str(bad), str(tmp_path / "out")]) == 2
    assert (f"error: {bad}: not a complete, intact checkpoint: no completion marker sft_checkpoint_complete.json (its "
            "save did not finish)") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # the --output_dir that holds it: named, with the newest complete checkpoint (none here)
    assert export_main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "is an --output_dir holding checkpoints, not a checkpoint" in capsys.readouterr().err


def test_lora_checkpoint_copied_or_merged(tmp_path, tiny_model_dir, capsys):
    """A LoRA checkpoint: without --merge the adapter folder is copied (checksums equal the marker's); with --merge
    the merged folder gives the logits of base + adapter within 1e-4."""
    from peft import LoraConfig, PeftModel, get_peft_model

    ckpt = tmp_path / "checkpoint-2"
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    model.save_pretrained(ckpt)
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(ckpt)
    torch.save({}, ckpt / "optimizer.pt")
    mark_complete(str(ckpt), {"world_size": 1})
    assert export_main([str(ckpt), str(tmp_path / "adapter")]) == 0
    assert "checksum the checkpoint's completion marker recorded" in capsys.readouterr().out
    copied = set(os.listdir(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= copied
    assert "optimizer.pt" not in copied and "sft_checkpoint_complete.json" not in copied
    assert export_main([str(ckpt), str(tmp_path / "merged"), "--merge"]) == 0
    stdout = capsys.readouterr().out
    assert _diff_line(stdout) <= 1e-4, stdout
    with torch.no_grad():
        want = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32), str(ckpt)).eval()(input_ids=IDS).logits
    got = _logits(tmp_path / "merged")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (got - _logits(tiny_model_dir)).abs().max() > 1e-3
