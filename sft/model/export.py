"""Merge a LoRA adapter into its base model and write a folder that loads offline with plain
``AutoModelForCausalLM.from_pretrained(dir)``, with the tokenizer (chat template) and a generation
config whose EOS includes the end-of-turn token."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from typing import Callable, Optional

import torch
import transformers

from sft.compat.peft import without_gptqmodel, without_v4_moe_conversion
from sft.errors import SFTError, explain_load_errors
from sft.logs import quiet_libraries
from sft.model.architecture import auto_class_of
from sft.model.loading import require_vocabulary
from sft.model.quantized import loading_fix, merge_problem, read_quantization

logger = logging.getLogger(__name__)

# What save_pretrained writes for a model (or a peft adapter) and tokenizer: the only files --overwrite may replace.
MODEL_FILES = re.compile(r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
                         r"adapter_config\.json|adapter_model\.safetensors|"
                         r"model\.safetensors\.index\.json|tokenizer(_config)?\.json|special_tokens_map\.json|"
                         r"chat_template\.(jinja|json)|vocab\.json|merges\.txt|added_tokens\.json|tokenizer\.model)$")


def merge_adapter(adapter_dir: str, out_dir: str, base: Optional[str] = None, overwrite: bool = False) -> str:
    """Merge ``adapter_dir`` (a peft LoRA folder written by finetune.py) into its base model.

    Args:
        base: base model folder; default: ``base_model_name_or_path`` recorded in adapter_config.json. An adapter
            trained on a pre-quantized base (GPTQ, bitsandbytes 4-bit) is merged into the 16-bit model given here.
        overwrite: allow writing into a non-empty ``out_dir``.

    Raises:
        SFTError: missing adapter/base folder, a pre-quantized base folder (:func:`sft.model.quantized.merge_problem`),
            or ``out_dir`` not empty without ``overwrite``.
    """
    from peft import PeftModel

    quiet_libraries()
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
    with explain_load_errors("tokenizer", adapter_dir,
                             "the adapter folder should hold the tokenizer finetune.py saved"):
        tok = transformers.AutoTokenizer.from_pretrained(adapter_dir)
    require_vocabulary(tok, adapter_dir, "the adapter folder should hold the tokenizer finetune.py saved")
    with explain_load_errors("base model", base, "give the base model's folder with --base"):
        model = auto_class_of(base).from_pretrained(base, dtype=torch.float32)
    if len(tok) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tok))
    with explain_load_errors("adapter", adapter_dir, "check that it was trained on this base model"):
        with without_gptqmodel(), without_v4_moe_conversion():  # a 16-bit base here (a quantized one: refused)
            model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    gen_path = os.path.join(adapter_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        model.generation_config = transformers.GenerationConfig.from_pretrained(adapter_dir)
    model.config.use_cache = True
    model.config.pad_token_id = tok.pad_token_id

    def write(tmp: str) -> None:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return write_folder(out_dir, write, ".merge-")


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


def generate_reply(model_dir: str, prompt: str, max_new_tokens: int = 48, system: Optional[str] = None) -> str:
    """Greedy reply of a saved model folder to one user message, rendered with its chat template."""

    quiet_libraries()
    fix = "give a model folder written by finetune.py or scripts/merge_adapter.py"
    with explain_load_errors("tokenizer", model_dir, fix):
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    require_vocabulary(tok, model_dir, fix)
    with explain_load_errors("model", model_dir, loading_fix(read_quantization(model_dir)) or fix):
        model = auto_class_of(model_dir).from_pretrained(model_dir)
    if not tok.chat_template:
        raise SFTError(f"{model_dir}: the tokenizer has no chat template; {fix}")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
