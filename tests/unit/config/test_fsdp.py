"""FSDP2 settings checked in process, before any model is loaded: every bad ``--fsdp`` / ``--fsdp_config`` and
every refused combination exits 2 with the reason, naming the flag and the fix; valid settings pass; the
shipped configs pass our checks and become accelerate's FSDP2 plugin unchanged. FSDP2 training under torchrun
is in tests/integration/distributed/test_deepspeed.py (the support matrix) and
tests/integration/distributed/test_fsdp.py.
"""
import json
import os

import pytest

from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT

FT = os.path.join(ROOT, "finetune")
FULL_SHARD = os.path.join(FT, "fsdp_config_full_shard.json")
OFFLOAD = os.path.join(FT, "fsdp_config_full_shard_offload.json")
ZERO2 = os.path.join(FT, "ds_config_zero2.json")

BAD = [
    # (id, JSON text or None, flags ({c} = that JSON file, {d} = its folder), expected fragment)
    ("missing-file", None, ["--fsdp", "--fsdp_config", "{d}/nope.json"],
     "nope.json: no such file; give an FSDP JSON config such as"),
    ("dangling-link", None, ["--fsdp", "--fsdp_config", "{d}/link.json"],
     "link.json: a symlink to the missing ../sft/config/shipped/fsdp_config_full_shard.json; give an FSDP JSON config"),
    ("a-folder", None, ["--fsdp", "--fsdp_config", "{d}"], ": not a file; give an FSDP JSON config"),
    ("empty", None, ["--fsdp", "--fsdp_config", ""], "--fsdp_config is empty; give an FSDP JSON config"),
    ("invalid-json", '{"version": 2,}', ["--fsdp", "--fsdp_config", "{c}"], "invalid JSON at line 1 column 15"),
    ("not-utf8", b'{"version": 2, "x": "\xff"}', ["--fsdp", "--fsdp_config", "{c}"], "not UTF-8 text (byte 21)"),
    ("top-level-list", "[2]", ["--fsdp", "--fsdp_config", "{c}"], "the top level is a JSON list; it must be an object"),
    ("misspelled-key", '{"reshard_after_foward": true}', ["--fsdp", "--fsdp_config", "{c}"],
     'unknown key reshard_after_foward (did you mean "reshard_after_forward"?); transformers would ignore it'),
    ("fsdp1-only-key", '{"fsdp_backward_prefetch": "BACKWARD_PRE"}', ["--fsdp", "--fsdp_config", "{c}"],
     "unknown key backward_prefetch"),
    ("bool-as-text", '{"cpu_offload": "yes"}', ["--fsdp", "--fsdp_config", "{c}"],
     'cpu_offload must be true or false (got "yes")'),
    ("bad-wrap-policy", '{"auto_wrap_policy": "LAYER_WRAP"}', ["--fsdp", "--fsdp_config", "{c}"],
     'auto_wrap_policy must be one of TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP (got "LAYER_WRAP")'),
    ("bad-state-dict-type", '{"state_dict_type": "LOCAL_STATE_DICT"}', ["--fsdp", "--fsdp_config", "{c}"],
     "state_dict_type must be one of FULL_STATE_DICT, SHARDED_STATE_DICT"),
    ("async-with-full-state-dict", '{"state_dict_type": "FULL_STATE_DICT"}',
     ["--fsdp", "--fsdp_config", "{c}", "--save_async", "True"],
     '"state_dict_type": "FULL_STATE_DICT": a full state dict is gathered to rank 0 at every save, which is what an '
     'asynchronous save exists to avoid'),
    ("save-only-model-sharded", '{"state_dict_type": "SHARDED_STATE_DICT"}',
     ["--fsdp", "--fsdp_config", "{c}", "--save_only_model", "True"],
     '"state_dict_type": "SHARDED_STATE_DICT": the checkpoints would hold no weights at all'),
    ("async-with-deepspeed", None, ["--deepspeed", ZERO2, "--save_async", "True"],
     f"--save_async True with --deepspeed {ZERO2}: DeepSpeed writes its ZeRO checkpoint itself, synchronously"),
    ("fsdp1", '{"fsdp_version": 1}', ["--fsdp", "--fsdp_config", "{c}"],
     'version 1: only FSDP2 ("version": 2, the default) is supported'),
    ("xla", '{"xla": true}', ["--fsdp", "--fsdp_config", "{c}"], "xla true: XLA FSDP (TPUs) is not supported"),
    ("inline-json", None, ["--fsdp", "--fsdp_config", '{"cpu_offload": 1}'],
     "--fsdp_config (inline JSON): cpu_offload must be true or false (got 1)"),
    ("legacy-option", None, ["--fsdp", "full_shard hybrid_shard", "--fsdp_config", FULL_SHARD],
     "--fsdp full_shard hybrid_shard: unknown option(s) hybrid_shard; pass --fsdp alone"),
    ("config-without-fsdp", None, ["--fsdp_config", FULL_SHARD], "has no effect without --fsdp; add --fsdp"),
    ("with-deepspeed", None, ["--fsdp", "--fsdp_config", FULL_SHARD, "--deepspeed", ZERO2],
     "--fsdp with --deepspeed " + ZERO2 + ": choose one sharding engine (FSDP2 or DeepSpeed ZeRO)"),
    ("offload-on-cpu", None, ["--fsdp", "--fsdp_config", OFFLOAD],
     '"cpu_offload": true on CPU: FSDP2\'s offload pins host memory for GPU copies and fails without a GPU'),
    ("qlora", None, ["--fsdp", "--fsdp_config", FULL_SHARD, "--use_lora", "True", "--q_lora", "True"],
     "--q_lora True with --fsdp: FSDP2 shards every weight as a DTensor, and bitsandbytes' packed 4-bit weights"),
    ("two-activation-checkpointings", '{"activation_checkpointing": true}',
     ["--fsdp", "--fsdp_config", "{c}", "--gradient_checkpointing", "True"],
     '"activation_checkpointing": true: choose one (transformers refuses both)'),
]


def train(flags, model_dir, tmp_path, capsys):
    from sft.cli import train_main

    data = write_jsonl(tmp_path / "toy.jsonl", TOY)
    rc = train_main(["--model_name_or_path", model_dir, "--data_path", data, "--output_dir", str(tmp_path / "out"),
                     "--report_to", "none", *flags])
    return rc, capsys.readouterr().err


@pytest.fixture
def forget_ds_config():
    """transformers keeps the last parsed DeepSpeed config in a module global; drop it after the test."""
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


@pytest.mark.parametrize("text,flags,fragment", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_fsdp_settings_stop_before_loading(text, flags, fragment, tiny_model_dir, tmp_path, capsys,
                                               forget_ds_config):
    cfg = tmp_path / "fsdp.json"
    os.symlink("../sft/config/shipped/fsdp_config_full_shard.json", tmp_path / "link.json")  # cp -P of the shipped link
    if text is not None:
        cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    flags = [f.replace("{c}", str(cfg)).replace("{d}", str(tmp_path)) for f in flags]
    rc, err = train(flags, tiny_model_dir, tmp_path, capsys)
    assert rc == 2 and fragment in err and "Traceback" not in err, err[-2000:]
    assert "LoRA r=" not in err  # nothing was loaded
    assert not (tmp_path / "out").exists()


def test_relative_config_path_names_the_shipped_file(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = train(["--fsdp", "--fsdp_config", "fsdp_config_full_shard.json"], tiny_model_dir, tmp_path, capsys)
    from sft.config.fsdp import SHIPPED

    assert rc == 2 and \
        f"the shipped fsdp_config_full_shard.json is {os.path.join(SHIPPED, 'fsdp_config_full_shard.json')}" in err


@pytest.mark.parametrize("fsdp", [[], ["True"], ["full_shard auto_wrap"]], ids=["bare", "True", "legacy-string"])
def test_valid_fsdp2_settings_pass(fsdp, tiny_model_dir, tmp_path):
    from sft.app.validation import validate
    from sft.config.arguments import parse_args

    data = write_jsonl(tmp_path / "toy.jsonl", TOY)
    args = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", data, "--output_dir",
                       str(tmp_path / "out"), "--report_to", "none", "--use_lora", "True", "--fsdp", *fsdp,
                       "--fsdp_config", FULL_SHARD])
    validate(*args)  # raises ConfigError on any problem
    t = args[2]
    assert t.fsdp is True and t.fsdp_plugin_args["fsdp_version"] == 2 and "cpu_offload" not in t.fsdp_plugin_args
    assert t.parsed.fsdp == (fsdp[0] if fsdp else True)  # as typed, for messages


@pytest.mark.parametrize("path", [FULL_SHARD, OFFLOAD], ids=os.path.basename)
def test_shipped_configs_become_accelerates_fsdp2_plugin(path):
    """Each shipped JSON passes our checks and, through transformers 5.24's TrainingArguments, becomes
    accelerate's FSDP2 plugin: version 2, parameters resharded after forward (full shard), the transformer
    blocks wrapped, sharded state dicts (each rank writes its shards), CPU offload exactly in the offload config."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    from sft.config.arguments import TrainingArguments
    from sft.config.fsdp import read_fsdp_config

    config, problems = read_fsdp_config(path)
    assert problems == [] and config["version"] == 2
    assert json.load(open(path)) == config  # nothing to strip or rename in the shipped files
    args = TrainingArguments(output_dir="unused", fsdp=True, fsdp_config=path, report_to="none")
    assert args.parsed.fsdp_problems == () and args.fsdp_plugin_args["fsdp_version"] == 2
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.auto_wrap_policy is not None and "transformer" in str(plugin.auto_wrap_policy)
    assert str(plugin.state_dict_type).endswith("SHARDED_STATE_DICT")
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == ("offload" in path)



@pytest.mark.parametrize("files,flags,fragment", [
    (["pytorch_model_fsdp.bin"], ["--fsdp", "--fsdp_config", FULL_SHARD],
     'holds FSDP2 full state dicts (pytorch_model_fsdp.bin, "state_dict_type": "FULL_STATE_DICT", as the shipped'),
    (["pytorch_model_fsdp_0/.metadata"], [], "holds FSDP2 shards (pytorch_model_fsdp_0/"),
    (["optimizer.pt", "model.safetensors"], ["--fsdp", "--fsdp_config", FULL_SHARD],
     "holds a checkpoint written without --fsdp, which this run's settings do not load; resume without --fsdp"),
], ids=["full-state-dicts-under-the-sharded-config", "shards-without-fsdp", "ddp-under-fsdp"])
def test_a_checkpoint_in_another_fsdp_layout_is_refused_before_loading(files, flags, fragment, tiny_model_dir,
                                                                       tmp_path, capsys):
    """The upgrade path: a run started with the shipped config of before (full state dicts) resumed after it became
    sharded, and a checkpoint resumed with --fsdp switched on or off: one line naming the setting that loads it."""
    from sft.train.checkpoint import mark_complete

    ckpt = tmp_path / "out" / "checkpoint-2"
    for name in ["trainer_state.json", *files]:
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_text("{}")
    mark_complete(str(ckpt), {})
    rc, err = train(flags, tiny_model_dir, tmp_path, capsys)
    assert rc == 2 and fragment in err and "Traceback" not in err, err[-2000:]
