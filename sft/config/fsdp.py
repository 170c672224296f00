"""Reading and checking ``--fsdp`` / ``--fsdp_config`` (PyTorch FSDP2 through transformers and accelerate)
before anything heavy loads.

transformers 5.24 (``TrainingArguments._process_fsdp_args``) opens the ``--fsdp_config`` file inside
``__post_init__`` (a bad file is a bare traceback there), strips a leading ``fsdp_`` from each key, and reads
only the keys in :data:`KNOWN_KEYS` (any other key is silently ignored); accelerate 1.15 then builds its
``FullyShardedDataParallelPlugin`` from them. Here the file is read first and every problem is returned as
one line naming the flag, the value and the fix; :func:`sft.app.validation.validate` reports them with every
other problem. Nothing here changes any state.
"""
from __future__ import annotations

import difflib
import json
import os
from typing import Optional

from sft.config.json_file import SHIPPED, load_json_flag

# The shipped configs are package data (sft/config/shipped/; finetune/fsdp_config_*.json link to them).
EXAMPLE = os.path.join(SHIPPED, "fsdp_config_full_shard.json")

# The keys transformers 5.24 reads for FSDP2 (after stripping "fsdp_"), with the values each may take
# (None: any JSON value of the given type).
BOOL_KEYS = ("cpu_offload", "reshard_after_forward", "cpu_ram_efficient_loading", "activation_checkpointing")
CHOICES = {"auto_wrap_policy": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
           "state_dict_type": ("FULL_STATE_DICT", "SHARDED_STATE_DICT")}
OTHER_KEYS = ("version", "min_num_params", "transformer_layer_cls_to_wrap", "xla", "xla_fsdp_v2",
              "xla_fsdp_grad_ckpt", "xla_fsdp_settings")
KNOWN_KEYS = BOOL_KEYS + tuple(CHOICES) + OTHER_KEYS
# Items of the legacy string form (``--fsdp "full_shard auto_wrap"``) that FSDP2 accepts.
LEGACY_ITEMS = ("full_shard", "shard_grad_op", "offload", "auto_wrap")


def normalize_fsdp_flag(value) -> tuple[object, list[str]]:
    """``--fsdp`` as typed -> ``(value for transformers, problems)``.

    Bare ``--fsdp`` (argparse's const) and ``True``/``true``/``1`` mean on (``True``); ``False``/``false``/``0``/
    an empty string mean off (``None``); otherwise the legacy space-separated form, each item one of
    :data:`LEGACY_ITEMS` (kept as the string: transformers translates it, see the module docstring).
    """
    if value is None or value is True:
        return value, []
    text = str(value).strip()
    if text.lower() in ("true", "1", "yes"):
        return True, []
    if text.lower() in ("false", "0", "no", ""):
        return None, []
    bad = [item for item in text.split() if item not in LEGACY_ITEMS]
    if bad:
        return None, [f"--fsdp {value}: unknown option(s) {', '.join(bad)}; pass --fsdp alone (FSDP2, configured by "
                      f"--fsdp_config {EXAMPLE}) or items of {' '.join(LEGACY_ITEMS)}"]
    return text, []


def _load(value: str) -> tuple[Optional[object], str, list[str]]:
    return load_json_flag("--fsdp_config", value, "an FSDP", EXAMPLE)


def read_fsdp_config(value) -> tuple[Optional[dict], list[str]]:
    """Read and check ``--fsdp_config VALUE`` (a file path, inline JSON text ``{...}`` as a YAML mapping becomes,
    or an already parsed dict). Returns ``(config with the "fsdp_" prefixes stripped, or None; problems)``.

    Refused: a missing/unreadable file, invalid JSON, a top level that is not an object, a key transformers
    does not read (it would be ignored silently; the nearest valid name is suggested), a ``version`` other
    than 2 (FSDP1 is deprecated in transformers 5.24 and not supported here), a non-boolean where a
    boolean is read, and a value outside the choices of ``auto_wrap_policy`` / ``state_dict_type``.
    """
    if isinstance(value, dict):
        config, flag, problems = value, "--fsdp_config", []
    elif not str(value).strip():
        return None, [f"--fsdp_config is empty; give an FSDP JSON config such as {EXAMPLE}"]
    else:
        config, flag, problems = _load(str(value))
    if problems:
        return None, problems
    if not isinstance(config, dict):
        kind = "list" if isinstance(config, list) else type(config).__name__
        return None, [f"{flag}: the top level is a JSON {kind}; it must be an object {{...}} like {EXAMPLE}"]
    config = {k[5:] if k.startswith("fsdp_") else k: v for k, v in config.items()}
    for key, v in config.items():
        if key not in KNOWN_KEYS:
            near = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            hint = f' (did you mean "{near[0]}"?)' if near else f"; valid keys: {', '.join(KNOWN_KEYS)}"
            problems.append(f"{flag}: unknown key {key}{hint}; transformers would ignore it silently")
        elif key in BOOL_KEYS and not isinstance(v, bool):
            problems.append(f"{flag}: {key} must be true or false (got {json.dumps(v)})")
        elif key in CHOICES and v not in CHOICES[key]:
            problems.append(f"{flag}: {key} must be one of {', '.join(CHOICES[key])} (got {json.dumps(v)})")
    version = config.get("version", 2)
    if version not in (2, "2"):
        problems.append(f"{flag}: version {json.dumps(version)}: only FSDP2 (\"version\": 2, the default) is "
                        "supported; FSDP1 is deprecated in transformers 5.24")
    if config.get("xla"):
        problems.append(f"{flag}: xla true: XLA FSDP (TPUs) is not supported here; remove it")
    return (None if problems else config), problems

