"""sft.app.settings: the run's derived settings, frozen, and the only writer of training_args after validation."""
import dataclasses

import pytest

from sft.app.settings import apply_memory_plan, apply_run_shape, derive, with_memory_plan
from sft.config.arguments import parse_args
from sft.config.settings import DeepSpeedRebuild, RunSettings
from sft.distributed.process_group import Runtime
from sft.train.resume import ResumePlan
from sft.train.world_size import WorldSizeChange

ONE = Runtime(world_size=1, rank=0, local_rank=0, device="cpu", backend=None)


def _args(tmp_path, *extra):
    return parse_args(["--model_name_or_path", "m", "--data_path", "d.jsonl", "--output_dir", str(tmp_path / "o"),
                       "--report_to", "none", *extra])[2]


def test_derived_once_frozen_and_written_by_the_two_appliers(tmp_path):
    t = _args(tmp_path, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
              "--save_total_limit", "3")
    change = WorldSizeChange("ck", old_world_size=1, world_size=1, micro_batch=2, old_grad_accum=4, grad_accum=2,
                             global_batch=4)
    s = derive(t, ONE, ResumePlan(checkpoint="ck", change=change), sft_rotation=True)
    assert (s.world_size, s.micro_batch, s.configured_grad_accum, s.grad_accum, s.global_batch) == (1, 2, 4, 2, 4)
    assert (s.resume, s.deepspeed_rebuild) == ("ck", DeepSpeedRebuild.NONE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.grad_accum = 8
    assert (t.gradient_accumulation_steps, t.save_total_limit) == (4, 3)  # deriving writes nothing
    apply_run_shape(t, s)
    assert (t.gradient_accumulation_steps, t.save_total_limit, s.save_total_limit) == (2, None, 3)
    planned = with_memory_plan(s, 1000, True)
    assert (planned.max_tokens_per_micro_batch, planned.activation_checkpointing) == (1000, True) and s is not planned
    assert with_memory_plan(planned, None, False) == planned  # the plan keeps a budget and checkpointing it had
    apply_memory_plan(t, planned)
    assert t.max_tokens_per_micro_batch == 1000 and t.activation_checkpointing and t.gradient_checkpointing
    assert t.activation_checkpointing_kwargs == {"use_reentrant": False}


def test_a_precision_another_rank_refused_is_written_with_what_transformers_derives_from_it(tmp_path):
    """--bf16 auto chose bf16 here, another rank fp32 (sft.config.precision.agree_across_ranks): the agreed fp32
    reaches bf16 and transformers' mixed_precision, which its __post_init__ derived from the local choice."""
    t = _args(tmp_path, "--bf16", "True")
    assert t.bf16 and t.mixed_precision == "bf16"
    s = dataclasses.replace(derive(t, ONE), bf16=False, bf16_reason="auto; another rank chose fp32")
    apply_run_shape(t, s)
    assert (t.bf16, t.mixed_precision) == (False, "no")
    assert RunSettings(1, 1, 1, 1).bf16 is False


def test_parsing_records_what_it_learned_in_one_frozen_declared_value(tmp_path):
    """What parsing learns beyond the flags is one frozen value in a declared field, not attributes added to the
    arguments (TrainingArguments.parsed); it is no flag and no YAML key."""
    t = _args(tmp_path, "--bf16", "auto", "--gradient_checkpointing", "True")
    assert t.parsed.bf16 == "auto" and t.parsed.activation_checkpointing is True and t.parsed.zero_stage == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.parsed.zero_stage = 3
    import transformers

    base = transformers.TrainingArguments(output_dir=str(tmp_path / "b"), report_to="none", use_cpu=True)
    transformers_own = set(vars(base)) - {f.name for f in dataclasses.fields(base)}  # what transformers adds itself
    assert set(vars(t)) - {f.name for f in dataclasses.fields(t)} <= transformers_own
    assert "parsed" not in t.to_dict()
