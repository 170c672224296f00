"""Reading and checking a DeepSpeed JSON config before anything heavy loads.

transformers' integration fills every ``"auto"`` value from the TrainingArguments
(``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig``), so the flags stay the one source of
truth; here we only refuse what would silently change the run.
"""
from __future__ import annotations

import json
import os
from typing import Optional


def read_ds_config(path: str, lr_scheduler_type: str) -> tuple[Optional[dict], list[str]]:
    """Load ``--deepspeed PATH`` and return ``(config, problems)``; ``config`` is None when unusable.

    Problems (one line each, naming the flag, the file and the fix):

    - the file is missing, unreadable, not JSON, or not a JSON object;
    - ``zero_optimization.stage`` is not 0, 1, 2 or 3;
    - a ``scheduler`` block: DeepSpeed would then build its own LR scheduler and transformers would not
      build ``--lr_scheduler_type`` at all (Qwen's shipped ``WarmupLR`` block keeps the LR flat after
      warmup instead of the cosine decay the flags ask for). Refused rather than warned about, because the
      result is a different training run than the command line says.
    """
    flag = f"--deepspeed {path}"
    if not os.path.exists(path):
        return None, [f"{flag}: no such file; give a DeepSpeed JSON config such as finetune/ds_config_zero2.json"]
    if not os.path.isfile(path):
        return None, [f"{flag}: not a file; give a DeepSpeed JSON config such as finetune/ds_config_zero2.json"]
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except UnicodeDecodeError as e:
        return None, [f"{flag}: not UTF-8 text (byte {e.start}); save it as UTF-8 JSON"]
    except json.JSONDecodeError as e:
        return None, [f"{flag}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; fix the file "
                      "(finetune/ds_config_zero2.json is a valid example)"]
    except OSError as e:
        return None, [f"{flag}: cannot read the file ({e.strerror})"]
    if not isinstance(config, dict):
        return None, [f"{flag}: the top level is a JSON {type(config).__name__}, not an object {{...}} of "
                      "DeepSpeed settings"]
    problems = []
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if not isinstance(zero, dict) or stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        problems.append(f"{flag}: zero_optimization.stage must be 0, 1, 2 or 3 (got {stage!r})")
    if "scheduler" in config:
        kind = config["scheduler"].get("type", "?") if isinstance(config["scheduler"], dict) else "?"
        problems.append(f"{flag}: has a \"scheduler\" block ({kind}); DeepSpeed would use it instead of "
                        f"--lr_scheduler_type {lr_scheduler_type} (e.g. WarmupLR keeps the learning rate flat after "
                        "warmup); delete the block and choose the schedule with --lr_scheduler_type / --warmup_steps")
    return (config if not problems else None), problems


def zero_stage(config: Optional[dict]) -> int:
    """ZeRO stage of a checked config (0 when there is no ``zero_optimization`` block or no config)."""
    if not config:
        return 0
    return int(config.get("zero_optimization", {}).get("stage", 0))


def mismatch_problems(path: str, mismatches: list[str]) -> list[str]:
    """Turn transformers' ``HfTrainerDeepSpeedConfig.mismatches`` lines (``- ds KEY=V vs hf FLAG=W``) into
    our one-line problems: a number in the JSON that disagrees with a flag."""
    out = []
    for line in mismatches:
        text = line.strip().lstrip("- ").strip()
        out.append(f"--deepspeed {path}: {text.replace('ds ', 'JSON ', 1).replace(' vs hf ', ' but flag ')}; "
                   "set the JSON value to \"auto\" (the flags then decide) or make them equal")
    return out
