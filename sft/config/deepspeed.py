"""Reading and checking a DeepSpeed JSON config before anything heavy loads.

transformers' integration fills every ``"auto"`` value from the TrainingArguments
(``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig``), so the flags stay the one source of
truth; here we only refuse what would silently change the run.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from sft.config.json_file import SHIPPED, load_json_flag

# The shipped configs are package data (sft/config/shipped/; finetune/ds_config_*.json link to them).
EXAMPLE = os.path.join(SHIPPED, "ds_config_zero2.json")
# blocks that transformers or DeepSpeed read as objects; any other type crashes inside them
OBJECT_BLOCKS = ("fp16", "bf16", "zero_optimization", "optimizer", "scheduler", "checkpoint")


def _load(value: str) -> tuple[Optional[object], str, list[str]]:
    return load_json_flag("--deepspeed", value, "a DeepSpeed", EXAMPLE)


def _zero_problems(flag: str, zero: dict) -> list[str]:
    """Check ``zero_optimization`` with DeepSpeed's own schema (pydantic; unknown keys are errors), the
    ``"auto"`` values that transformers fills replaced by placeholders."""
    import difflib

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    filled = {k: (1 if v == "auto" else v) for k, v in zero.items()}
    try:
        DeepSpeedZeroConfig(**filled)
    except ValidationError as e:
        out = []
        names = set(DeepSpeedZeroConfig.model_fields) | {f.alias for f in DeepSpeedZeroConfig.model_fields.values()
                                                         if f.alias}
        for err in e.errors()[:5]:
            key = "zero_optimization." + ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                near = difflib.get_close_matches(str(err["loc"][0]), sorted(names), n=1, cutoff=0.6)
                hint = f" (did you mean \"{near[0]}\"?)" if near else ""
                out.append(f"{flag}: unknown key {key}{hint}; DeepSpeed rejects it")
            else:
                out.append(f"{flag}: {key}: {err['msg']} (got {err.get('input')!r})")
        return out
    except (TypeError, ValueError) as e:
        return [f"{flag}: zero_optimization: {str(e).splitlines()[0][:200]}"]
    return []


def read_ds_config(value: str, lr_scheduler_type: str) -> tuple[Optional[dict], list[str]]:
    """Load ``--deepspeed VALUE`` (a JSON file, or inline JSON) and return ``(config, problems)``;
    ``config`` is None when there is any problem.

    Everything that would otherwise fail only after the model has loaded, or silently change the run, is a
    problem (one line each, naming the flag, the key and the fix):

    - missing/unreadable file, invalid JSON, not an object; a block of ``OBJECT_BLOCKS`` that is not an object;
    - no ``zero_optimization`` block (accelerate requires one), or one DeepSpeed's schema rejects (unknown or
      misspelled keys, wrong types, a stage outside 0-3);
    - neither ``train_micro_batch_size_per_gpu`` nor ``train_batch_size`` (DeepSpeed needs one; transformers
      fills only keys that are present and ``"auto"``);
    - a ``scheduler`` block: DeepSpeed would then build its own LR scheduler and transformers would not build
      ``--lr_scheduler_type`` at all (Qwen's shipped ``WarmupLR`` block keeps the LR flat after warmup
      instead of the cosine decay the flags ask for). Refused rather than warned about, because the result
      is a different training run than the command line says;
    - optimizer offload without an ``optimizer`` block and without ``"zero_force_ds_cpu_optimizer": false``:
      DeepSpeed would then compile DeepSpeedCPUAdam (minutes of C++) or refuse transformers' optimizer.
    """
    if not value.strip():
        return None, ["--deepspeed is empty; give a DeepSpeed JSON config (e.g. " + EXAMPLE + ") or omit the flag"]
    config, flag, problems = _load(value)
    if problems:
        return None, problems
    if not isinstance(config, dict):
        return None, [f"{flag}: the top level is a JSON {type(config).__name__}, not an object {{...}} of "
                      "DeepSpeed settings"]
    for key in OBJECT_BLOCKS:
        if key in config and not isinstance(config[key], dict):
            problems.append(f"{flag}: \"{key}\" must be an object {{...}} (got {json.dumps(config[key])[:40]}); "
                            f"see {EXAMPLE}")
    for key in ("optimizer", "scheduler"):
        params = config.get(key, {}).get("params", {}) if isinstance(config.get(key), dict) else {}
        if not isinstance(params, dict):
            problems.append(f"{flag}: \"{key}.params\" must be an object {{...}} (got {json.dumps(params)[:40]})")
    if problems:
        return None, problems
    zero = config.get("zero_optimization")
    if zero is None:
        problems.append(f"{flag}: no \"zero_optimization\" block; add e.g. \"zero_optimization\": {{\"stage\": 2}} "
                        f"(see {EXAMPLE})")
    else:
        stage = zero.get("stage", 0)
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            problems.append(f"{flag}: zero_optimization.stage must be 0, 1, 2 or 3 (got {stage!r})")
        else:
            problems += _zero_problems(flag, zero)
    if "train_micro_batch_size_per_gpu" not in config and "train_batch_size" not in config:
        problems.append(f"{flag}: neither \"train_micro_batch_size_per_gpu\" nor \"train_batch_size\"; add "
                        "\"train_micro_batch_size_per_gpu\": \"auto\" and \"gradient_accumulation_steps\": \"auto\" "
                        "(the flags then decide)")
    if "scheduler" in config:
        kind = config["scheduler"].get("type", "?")
        problems.append(f"{flag}: has a \"scheduler\" block ({kind}); DeepSpeed would use it instead of "
                        f"--lr_scheduler_type {lr_scheduler_type} (e.g. WarmupLR keeps the learning rate flat after "
                        "warmup); delete the block and choose the schedule with --lr_scheduler_type / --warmup_steps")
    offload = (zero or {}).get("offload_optimizer") if isinstance(zero, dict) else None
    if (isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme") and "optimizer" not in config
            and config.get("zero_force_ds_cpu_optimizer", True) is not False):
        problems.append(f"{flag}: offload_optimizer with transformers' optimizer needs "
                        "\"zero_force_ds_cpu_optimizer\": false (as in ds_config_zero3_offload.json); or add an "
                        "\"optimizer\" block to use DeepSpeedCPUAdam, which compiles C++ on first use")
    return (config if not problems else None), problems


def zero_stage(config: Optional[dict]) -> int:
    """ZeRO stage of a checked config (0 when there is no ``zero_optimization`` block or no config)."""
    if not config:
        return 0
    return int(config.get("zero_optimization", {}).get("stage", 0))


# transformers' names for the values it compares (integrations/deepspeed.py, 5.24) -> our flags
_HF_NAMES = {"fp16|fp16_full_eval": "--fp16", "bf16|bf16_full_eval": "--bf16",
             "adam_beta1+adam_beta2": "--adam_beta1/--adam_beta2",
             "train_batch_size (calculated)": "global batch (--per_device_train_batch_size x "
                                              "--gradient_accumulation_steps x world size)"}


def mismatch_problems(value: str, mismatches: list[str]) -> list[str]:
    """Turn transformers' ``HfTrainerDeepSpeedConfig.mismatches`` lines (``- ds KEY=V vs hf NAME=W``) into
    our one-line problems: a number in the JSON that disagrees with a flag."""
    import re

    flag = "--deepspeed (inline JSON)" if value.lstrip().startswith("{") else f"--deepspeed {value}"
    out = []
    for line in mismatches:
        m = re.match(r"\s*-?\s*ds (\S+)=(.*) vs hf (.+)=(.*)$", line)
        if not m:
            out.append(f"{flag}: {line.strip()}")
            continue
        key, ds_val, hf_name, hf_val = m.groups()
        name = _HF_NAMES.get(hf_name, "--" + hf_name)
        out.append(f"{flag}: JSON {key}={ds_val} but {name}={hf_val}; set the JSON value to \"auto\" (the flags "
                   "then decide) or make them equal")
    return out
