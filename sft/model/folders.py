"""The folders a model is written to and read from, checked before anything heavy is imported: the output folder
that must not lose the user's files, its atomic replacement, and a merge's inputs. Standard library only, so that
``sft-merge`` refuses a bad folder in a fraction of a second instead of after importing torch, transformers and peft
(~10 s of CPU in a process); ``sft-export`` still checks its folders after those imports."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Callable, Optional

from sft.errors import SFTError, explain_load_errors
from sft.model.quantized import merge_problem, read_quantization

# What save_pretrained writes for a model (or a peft adapter) and tokenizer: the only files --overwrite may replace.
MODEL_FILES = re.compile(r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
                         r"adapter_config\.json|adapter_model\.safetensors|"
                         r"model\.safetensors\.index\.json|tokenizer(_config)?\.json|special_tokens_map\.json|"
                         r"chat_template\.(jinja|json)|vocab\.json|merges\.txt|added_tokens\.json|tokenizer\.model)$")


def check_out_dir(out_dir: str, sources: dict[str, str], overwrite: bool) -> None:
    """Refuse an output folder that would lose the user's files: one that is, holds or lies inside a source folder
    (``{what it is: path}``, e.g. the adapter and the base model), a file, or a non-empty folder without
    ``overwrite`` (and with it, one holding anything but the files of a model folder, :data:`MODEL_FILES`).

    Raises:
        SFTError: naming ``out_dir``, the reason and the fix.
    """
    for name, src in sources.items():
        a, b = os.path.realpath(out_dir), os.path.realpath(src)
        if os.path.commonpath([a, b]) in (a, b):
            raise SFTError(f"{out_dir}: is, holds or lies inside the {name} folder {src}; write the model "
                           "to a separate folder")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SFTError(f"{out_dir}: is a file; give a folder path for the model")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not overwrite:
            raise SFTError(f"{out_dir}: not empty; choose another folder or pass --overwrite")
        foreign = sorted(f for f in os.listdir(out_dir) if not MODEL_FILES.match(f))
        if foreign:
            raise SFTError(f"{out_dir}: --overwrite replaces a model folder, but this one also holds "
                           f"{', '.join(foreign[:5])}; choose another folder")


def write_folder(out_dir: str, write: Callable[[str], None], prefix: str) -> str:
    """Have ``write(tmp)`` fill a fresh temporary folder next to ``out_dir``, then put it in place of ``out_dir``
    (an existing one, already checked by :func:`check_out_dir`, is moved aside and deleted only once the new one is
    in place; an interruption between the two renames puts it back). Returns ``out_dir`` as a real path."""
    out_dir = os.path.realpath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)  # a fresh name: never another folder of the user's
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the model from the user's group
    old = None
    try:
        write(tmp)
        if os.path.isdir(out_dir):  # only reached with overwrite=True or an empty folder
            old = tmp + ".old"  # moved aside (not deleted) until the new model is in place
            os.rename(out_dir, old)
        os.replace(tmp, out_dir)
    finally:
        # interrupted (a signal, a full disk) between the two renames: put the user's folder back
        if old is not None and os.path.isdir(old) and not os.path.exists(out_dir):
            os.rename(old, out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def check_merge_inputs(adapter_dir: str, out_dir: str, base: Optional[str] = None, overwrite: bool = False) -> str:
    """Check what :func:`sft.model.export.merge_adapter` reads and writes; return the base model folder (``base``, else
    ``base_model_name_or_path`` of ``adapter_dir``/adapter_config.json).

    Raises:
        SFTError: no adapter_config.json or adapter_model.safetensors in ``adapter_dir``, an adapter config that is
            not JSON, a base model folder that does not exist, a pre-quantized base
            (:func:`sft.model.quantized.merge_problem`), or an output folder :func:`check_out_dir` refuses.
    """
    cfg_path = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise SFTError(f"{adapter_dir}: no adapter_config.json; give the --output_dir of a LoRA run")
    if not os.path.isfile(os.path.join(adapter_dir, "adapter_model.safetensors")):
        raise SFTError(f"{adapter_dir}: no adapter_model.safetensors; the LoRA run did not finish saving")
    given_with_base = bool(base)
    with explain_load_errors("adapter config", cfg_path, "it must be the JSON file peft writes"):
        with open(cfg_path) as f:
            base = base or json.load(f).get("base_model_name_or_path")
    if not base or not os.path.isdir(base):
        raise SFTError(f"base model {base!r} not found; pass --base with the base model's folder")
    q = read_quantization(base)
    if q is not None:  # never a silently broken merge: the sum must land in 16-bit (or fp32) weights
        raise SFTError(merge_problem(base, q, given_with_base))
    check_out_dir(out_dir, {"adapter": adapter_dir, "base model": base}, overwrite)
    return base
