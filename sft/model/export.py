"""Merge a LoRA adapter into its base model and write a folder that loads offline with plain
``AutoModelForCausalLM.from_pretrained(dir)``, with the tokenizer (chat template) and a generation
config whose EOS includes the end-of-turn token."""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import transformers

from sft.compat.peft import without_gptqmodel, without_v4_moe_conversion
from sft.errors import SFTError, explain_load_errors
from sft.logs import quiet_libraries
from sft.model.architecture import auto_class_of
from sft.model.folders import check_merge_inputs, write_folder
from sft.model.loading import require_vocabulary
from sft.model.quantized import loading_fix, read_quantization

logger = logging.getLogger(__name__)


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
    base = check_merge_inputs(adapter_dir, out_dir, base, overwrite)
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
