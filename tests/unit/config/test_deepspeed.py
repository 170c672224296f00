"""DeepSpeed and Q-LoRA settings checked in process, before any model is loaded: bad DeepSpeed JSON and refused
combinations exit 2 with the reason, a YAML ``deepspeed:`` mapping is checked like a file, and the shipped
configs pass our checks and DeepSpeed's own config class. The support matrix run for real under torchrun is in
tests/integration/distributed/test_deepspeed.py.
"""
import json
import os

import pytest

from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT

FT = os.path.join(ROOT, "finetune")
ZERO3 = os.path.join(FT, "ds_config_zero3.json")


QWEN_ZERO2_WITH_WARMUPLR = {  # the shape of Qwen's shipped finetune/ds_config_zero2.json
    "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}


BAD_DS = [
    # (id, JSON text or None, extra flags ({c} = that JSON file, {d} = its folder), expected fragment)
    ("missing-file", None, ["--deepspeed", "{d}/nope.json"], "nope.json: no such file"),
    ("a-folder", None, ["--deepspeed", "{d}"], ": not a file; give a DeepSpeed JSON config"),
    ("invalid-json", '{"zero_optimization": {"stage": 2,}}', ["--deepspeed", "{c}"],
     "invalid JSON at line 1 column 35"),
    ("top-level-list", "[1, 2]", ["--deepspeed", "{c}"], "the top level is a JSON list"),
    ("bad-stage", '{"zero_optimization": {"stage": 5}}', ["--deepspeed", "{c}"], "stage must be 0, 1, 2 or 3 (got 5)"),
    ("scheduler-block", json.dumps(QWEN_ZERO2_WITH_WARMUPLR), ["--deepspeed", "{c}"],
     'has a "scheduler" block (WarmupLR); DeepSpeed would use it instead of --lr_scheduler_type linear'),
    ("batch-mismatch", '{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}',
     ["--deepspeed", "{c}", "--per_device_train_batch_size", "1"],
     "JSON train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size=1; set the JSON value to \"auto\""),
    # found by an adversarial run: each of these used to pass the check and crash after loading, or crash
    # with a traceback inside transformers while the flags were parsed
    ("no-batch-size", '{"zero_optimization": {"stage": 0}}', ["--deepspeed", "{c}"],
     'neither "train_micro_batch_size_per_gpu" nor "train_batch_size"; add "train_micro_batch_size_per_gpu": "auto"'),
    ("fp16-not-object", '{"zero_optimization": {"stage": 2}, "fp16": true}', ["--deepspeed", "{c}"],
     '"fp16" must be an object {...} (got true)'),
    ("optimizer-int", '{"zero_optimization": {"stage": 2}, "optimizer": 5}', ["--deepspeed", "{c}"],
     '"optimizer" must be an object {...} (got 5)'),
    ("optimizer-null", '{"zero_optimization": {"stage": 2}, "optimizer": null}', ["--deepspeed", "{c}"],
     '"optimizer" must be an object {...} (got null)'),
    ("optimizer-params-str", '{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": "x"}}',
     ["--deepspeed", "{c}"], '"optimizer.params" must be an object {...} (got "x")'),
    ("deep-json", '{"a": ' + "[" * 100000 + "]" * 100000 + "}", ["--deepspeed", "{c}"], "JSON nested too deeply"),
    ("no-zero-block", "{}", ["--deepspeed", "{c}"], 'no "zero_optimization" block; add e.g. "zero_optimization"'),
    ("misspelled-zero-key", '{"zero_optimization": {"Stage": 3}, "train_micro_batch_size_per_gpu": "auto"}',
     ["--deepspeed", "{c}"], 'unknown key zero_optimization.Stage (did you mean "stage"?)'),
    ("offload-compiles-cpu-adam", '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, '
     '"train_micro_batch_size_per_gpu": "auto"}', ["--deepspeed", "{c}"],
     'offload_optimizer with transformers\' optimizer needs "zero_force_ds_cpu_optimizer": false'),
    ("empty-flag", None, ["--deepspeed", ""], "--deepspeed is empty; give a DeepSpeed JSON config"),
    ("inline-json-zero3-qlora", None, ["--deepspeed", '{"zero_optimization": {"stage": 3}, '
     '"train_micro_batch_size_per_gpu": "auto"}', "--use_lora", "True", "--q_lora", "True"],
     "(ZeRO-3): ZeRO-3 partitions every weight"),
    ("qlora-zero3", None, ["--deepspeed", ZERO3, "--use_lora", "True", "--q_lora", "True"],
     "(ZeRO-3): ZeRO-3 partitions every weight across ranks"),
    ("qlora-without-lora", None, ["--q_lora", "True"], "--q_lora True: Q-LoRA trains a LoRA adapter on the 4-bit "
     "base model; add --use_lora True"),
]


@pytest.fixture
def forget_ds_config():
    """transformers keeps the last parsed DeepSpeed config in a module global; drop it after the test."""
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


@pytest.mark.parametrize("text,flags,fragment", [c[1:] for c in BAD_DS], ids=[c[0] for c in BAD_DS])
def test_bad_deepspeed_and_qlora_settings_stop_before_loading(text, flags, fragment, tiny_model_dir, tmp_path,
                                                             capsys, forget_ds_config):
    from sft.cli import train_main
    cfg = tmp_path / "ds.json"
    if text is not None:
        cfg.write_text(text)
    data = write_jsonl(tmp_path / "toy.jsonl", TOY)
    flags = [f.replace("{c}", str(cfg)).replace("{d}", str(tmp_path)) for f in flags]
    rc = train_main(["--model_name_or_path", tiny_model_dir, "--data_path", data, "--output_dir",
                        str(tmp_path / "out"), "--report_to", "none", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["ds_config_zero2.json", "ds_config_zero3.json", "ds_config_zero3_offload.json"])
def test_shipped_deepspeed_configs_pass_our_checks_and_deepspeeds(name):
    """Each shipped JSON: valid, no optimizer/scheduler block (HF's are used), every batch/accumulation/
    clipping/precision value "auto" (the flags decide), and DeepSpeed's own config class accepts it once
    transformers has filled the "auto" values."""
    from sft.config.deepspeed import read_ds_config, zero_stage

    path = os.path.join(FT, name)
    config, problems = read_ds_config(path, "cosine")
    assert problems == [] and config is not None
    assert "optimizer" not in config and "scheduler" not in config
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert config[key] == "auto", key
    assert config["bf16"]["enabled"] == "auto" and config["fp16"]["enabled"] == "auto"
    assert zero_stage(config) == (2 if "zero2" in name else 3)
    if zero_stage(config) == 3:
        assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    if "offload" in name:
        z = config["zero_optimization"]
        assert z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    from deepspeed.runtime.config import DeepSpeedConfig

    filled = json.loads(json.dumps(config))
    filled.update(train_batch_size=4, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                  gradient_clipping=1.0)
    filled["bf16"]["enabled"] = filled["fp16"]["enabled"] = False
    for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if filled["zero_optimization"].get(k) == "auto":
            filled["zero_optimization"][k] = 1000
    ds = DeepSpeedConfig(filled)
    assert ds.zero_optimization_stage == zero_stage(config)


def test_deepspeed_config_as_a_yaml_mapping(tiny_model_dir, tmp_path, capsys, forget_ds_config):
    """A YAML `deepspeed:` mapping becomes inline JSON and is checked like a file (here: ZeRO-3 + Q-LoRA)."""
    from sft.cli import train_main
    cfg = tmp_path / "train.yaml"
    cfg.write_text("deepspeed:\n  zero_optimization: {stage: 3}\n  train_micro_batch_size_per_gpu: auto\n"
                   "use_lora: true\nq_lora: true\n")
    data = write_jsonl(tmp_path / "toy.jsonl", TOY)
    rc = train_main(["--config", str(cfg), "--model_name_or_path", tiny_model_dir, "--data_path", data,
                        "--output_dir", str(tmp_path / "out"), "--report_to", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and "--deepspeed (inline JSON)" not in err and "(ZeRO-3): ZeRO-3 partitions" in err, err


def test_zero3_universal_load_gets_one_adam_step_counter_per_parameter_group(monkeypatch):
    """deepspeed 0.19.8's ZeRO-3 universal loader puts one and the same ``step`` tensor into every sub group's Adam
    state; torch's AdamW increments it in place per group, so two groups advance it twice per step (Adam's bias
    correction of a later step). sft.compat.deepspeed.separate_zero3_universal_steps gives each group its own copy. The
    loader is replaced by a stand-in that aliases the counter as DeepSpeed's does; the end-to-end case (ZeRO-3 full
    fine-tuning resumed at another world size) is in tests/integration/train/test_world_size_resume.py."""
    import types

    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    from sft.compat.deepspeed import separate_zero3_universal_steps

    flats = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]  # two sub groups' fp32 partitions
    adam = torch.optim.AdamW([{"params": [flats[0]]}, {"params": [flats[1]]}], lr=1e-3)
    for p in flats:
        p.grad = torch.ones_like(p)
    adam.step()  # both states exist now; step 1 each

    def aliasing_loader(self, checkpoint_dir):  # what DeepSpeed's loader does with the counter
        shared = torch.tensor(2.0)
        for flat in self.fp32_partitioned_groups_flat:
            self.optimizer.state[flat]["step"] = shared

    stub = types.SimpleNamespace(fp32_partitioned_groups_flat=flats, optimizer=adam)
    aliasing_loader(stub, "unused")
    adam.step()
    assert [adam.state[p]["step"].item() for p in flats] == [4.0, 4.0]  # the defect: 2 -> 4 in one step

    monkeypatch.setattr(Stage3, "load_hp_checkpoint_state_from_checkpoint_dir_stage3", aliasing_loader)
    separate_zero3_universal_steps()
    separate_zero3_universal_steps()  # idempotent: wrapped once
    wrapped = Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3
    assert wrapped is not aliasing_loader and wrapped.sft_separate_steps
    wrapped(stub, "unused")
    assert adam.state[flats[0]]["step"] is not adam.state[flats[1]]["step"]
    adam.step()
    assert [adam.state[p]["step"].item() for p in flats] == [3.0, 3.0]


def test_rebuilt_deepspeed_config_takes_the_recomputed_accumulation_and_leaves_the_users_file_alone(tmp_path):
    """sft.train.world_size.deepspeed_config_objects: after a resume recomputed the gradient accumulation (another
    world size, or the same world size after an earlier such resume), DeepSpeed's "auto" values follow it; the
    user's config file is not modified; load_universal adds only the checkpoint switch; sft.app.settings puts the
    objects on the arguments (the one writer)."""
    from transformers import TrainingArguments

    from sft.app.settings import apply_run_shape
    from sft.config.settings import DeepSpeedRebuild, RunSettings
    from sft.train.world_size import deepspeed_config_objects

    path = os.path.join(FT, "ds_config_zero2.json")
    before = open(path, encoding="utf-8").read()
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=path, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, use_cpu=True, report_to="none")
    assert args.hf_deepspeed_config.config["gradient_accumulation_steps"] == 2
    apply_run_shape(args, RunSettings(world_size=1, micro_batch=2, configured_grad_accum=2, grad_accum=3,
                                      deepspeed_rebuild=DeepSpeedRebuild.ACCUMULATION, bf16=bool(args.bf16)))
    config = args.hf_deepspeed_config.config
    assert args.gradient_accumulation_steps == 3 and args.deepspeed_plugin.hf_ds_config is args.hf_deepspeed_config
    assert (config["gradient_accumulation_steps"], config["train_batch_size"]) == (3, 6)
    assert "load_universal" not in (config.get("checkpoint") or {})
    hf_config, _ = deepspeed_config_objects(args, load_universal=True)
    assert hf_config.config["checkpoint"]["load_universal"] is True
    assert open(path, encoding="utf-8").read() == before
