"""bitsandbytes kept out of a training process whose flags need none of it.

peft imports bitsandbytes whenever it is installed (``peft/helpers.py``'s ``import bitsandbytes``; peft 0.21.2), and
transformers imports peft as soon as ``TrainingArguments`` is imported (transformers 5.24): every training process
pays bitsandbytes' import, about 1.0 s of CPU per process (bitsandbytes 0.50.2 registering its CPU kernels; measured
on a 2-core AMD EPYC Zen 4 with ``python -X importtime``), although only 4-bit/8-bit runs use it. Before those imports,
a process whose command line needs no bitsandbytes marks the package absent the way Python documents
(``sys.modules[name] = None``: ``import`` then raises ModuleNotFoundError and ``importlib.util.find_spec`` returns
None, which is how peft and transformers look for it), so they take their paths without it.

What needs bitsandbytes (any of them keeps it): ``--q_lora`` not false; an ``--optim`` other than torch's own
(:data:`TORCH_OPTIMIZERS`: ``adamw_bnb_8bit``, ``paged_*``, ``lion_*``, ``ademamix*`` ... are bitsandbytes');
a base model folder whose ``config.json`` has a ``quantization_config`` (a pre-quantized base); a base that is no
readable local folder (its config cannot be read before loading); a ``--config`` YAML file that cannot be read.
Only process entries call this (``finetune.py``, ``python -m sft train|check``, ``sft-train``): a process that
already imported peft keeps what it has.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

# transformers' OptimizerNames that are plain torch optimizers (transformers 5.24 training_args.py)
TORCH_OPTIMIZERS = frozenset({"adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop"})
_FALSE = frozenset({"false", "no", "0", "f", "n"})
_FLAGS = ("--q_lora", "--optim", "--model_name_or_path", "--config")


def keep_out_unless_needed(train_flags: Sequence[str]) -> bool:
    """Mark bitsandbytes absent in this process when ``train_flags`` (the flags of ``sft-train`` / ``sft-check``,
    without the program name) need none of it and neither peft nor bitsandbytes is imported yet. Returns True when
    it did. Reads at most the base model's ``config.json`` and the ``--config`` YAML file; raises nothing (a flag
    it cannot read keeps bitsandbytes)."""
    if "peft" in sys.modules or "bitsandbytes" in sys.modules or needs_bitsandbytes(train_flags):
        return False
    sys.modules["bitsandbytes"] = None
    return True


def needs_bitsandbytes(train_flags: Sequence[str]) -> bool:
    """True when the run these flags describe may use bitsandbytes (the rules of the module docstring)."""
    given = _flag_values(train_flags)
    if given is None:
        return True
    if given.get("--config") is not None:
        from_file = _yaml_values(given["--config"])
        if from_file is None:
            return True
        given = {**from_file, **{k: v for k, v in given.items() if k != "--config"}}
    if "--q_lora" in given and str(given["--q_lora"]).strip().lower() not in _FALSE:
        return True
    if "--optim" in given and str(given["--optim"]).strip().lower() not in TORCH_OPTIMIZERS:
        return True
    return _prequantized_or_unreadable(given.get("--model_name_or_path"))


def _flag_values(argv: Sequence[str]) -> Optional[dict]:
    """The values of :data:`_FLAGS` in ``argv`` (``--flag value``, ``--flag=value``, a bare boolean ``--q_lora``;
    argparse's unique abbreviations too). None when a flag's value is missing."""
    found = {}
    for i, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        name, eq, value = token.partition("=")
        flag = next((f for f in _FLAGS if len(name) > 3 and f.startswith(name)), None)
        if flag is None:
            continue
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                if flag != "--q_lora":
                    return None
                nxt = "true"
            value = nxt
        found[flag] = value
    return found


def _yaml_values(path: str) -> Optional[dict]:
    """``--flag: value`` for the keys of :data:`_FLAGS` a ``--config`` YAML file sets; None when unreadable."""
    try:
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f)
    except Exception:  # noqa: BLE001 - any failure: keep bitsandbytes; the parser reports the file itself
        return None
    if not isinstance(data, dict):
        return None
    return {f"--{k}": v for k, v in data.items() if f"--{k}" in _FLAGS and f"--{k}" != "--config"}


def _prequantized_or_unreadable(model: Optional[str]) -> bool:
    """True unless ``model`` is a local folder whose ``config.json`` reads as a JSON object without a
    ``quantization_config``."""
    if not model or not os.path.isdir(str(model)):
        return True
    try:
        with open(os.path.join(str(model), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return True
    return not isinstance(config, dict) or "quantization_config" in config
