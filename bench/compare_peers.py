"""The peers of bench/compare.py: TRL's SFTTrainer (``trl``, ``trl-best``) and LLaMA-Factory (``llamafactory``).

Imported by bench/compare.py (same folder); not part of the ``sft`` package. LLaMA-Factory runs in its own
virtual environment (``bash bench/setup_llamafactory.sh`` makes ``.venv-llamafactory``) through
bench/llamafactory_worker.py, which never imports ``sft``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LF_PYTHON = os.path.join(ROOT, ".venv-llamafactory", "bin", "python")
LF_WORKER = os.path.join(ROOT, "bench", "llamafactory_worker.py")


def marked_chatml_template(template: str) -> str:
    """The ChatML-style template of SmolLM2/Qwen with TRL's ``{% generation %}`` markers around each
    assistant reply and its ``<|im_end|>`` (the text it renders is unchanged).

    Raises:
        ValueError: the template is not the ChatML loop this rewrite knows.
    """
    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    if turn not in template:
        raise ValueError("not a ChatML-style template with the expected turn expression; give TRL a template with "
                         "{% generation %} markers yourself")
    marked = ("{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
              "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}" + turn + "{% endif %}")
    return template.replace(turn, marked)


# What `trl-best` sets on top of `trl` (TRL 1.16's SFTConfig field names, read from trl/trainer/sft_config.py):
# packing into rows of max_length by best-fit decreasing, which turns on padding-free batches (the rows of a
# micro batch flattened into one [1, tokens] row with position ids, trl/trainer/sft_trainer.py) on any device.
# Its LM head is already chunked and computed without materialising the full logits in every configuration
# (add_fused_lm_head; loss_type "chunked_nll" is a deprecated alias of the default "nll"), so there is no
# separate loss switch to turn on.
TRL_BEST = {"packing": True, "packing_strategy": "bfd", "padding_free": True, "loss_type": "nll"}


def run_length(a) -> dict:
    """The Trainer arguments that end a run (compare.py's ``--timing``): two epochs over the data (the first is
    warm-up, the second timed), or ``a.max_steps`` steps (the first one not timed). Ours gets them as flags, TRL as
    SFTConfig fields, LLaMA-Factory as config keys."""
    if getattr(a, "timing", "steps") == "epoch":
        return {"num_train_epochs": 2, "max_steps": -1}
    return {"max_steps": a.max_steps}


def build_trl(a, out_dir: str, best: bool):
    """A ``trl.SFTTrainer`` on the same model, data, LoRA and optimizer as ours; ``best``: :data:`TRL_BEST`
    with ``a.packing_batch`` packed rows per micro batch. Returns ``(trainer, extra result fields)``."""
    import datasets
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from sft.data.records.records import load_conversations
    from sft.data.template.chat import IGNORE_INDEX, encode_conversations
    from sft.model.loading import load_model, load_tokenizer, torch_dtype
    from sft.model.spec import LoadSpec

    tok, eot, grew = load_tokenizer(a.model)  # same pad token and template as ours
    ours_tok_template = tok.chat_template
    tok.chat_template = marked_chatml_template(ours_tok_template)
    model, _ = load_model(a.model, tok, grew, LoadSpec(dtype=torch_dtype(bf16=a.bf16)))
    convs = load_conversations(a.data, "error")
    ds = datasets.Dataset.from_list([{"messages": c.messages} for c in convs])
    layout = TRL_BEST if best else {"packing": False, "padding_free": False}
    cfg = SFTConfig(output_dir=out_dir, max_length=a.max_length, assistant_only_loss=True, **layout,
                    per_device_train_batch_size=a.packing_batch if best else a.batch, gradient_accumulation_steps=1,
                    learning_rate=2e-4, lr_scheduler_type="linear", weight_decay=0.0, optim="adamw_torch",
                    **run_length(a), logging_steps=1, save_strategy="no", report_to="none", bf16=a.bf16,
                    gradient_checkpointing=False, seed=0, disable_tqdm=True, use_cpu=not a.cuda)
    peft_config = LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=0.05, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=peft_config)
    extra = {"attn": trainer.model.config._attn_implementation}
    if best:
        return trainer, extra
    # equivalence check: TRL's tokens and assistant mask vs. ours on the first 200 conversations
    n = min(200, len(convs))
    tok.chat_template = ours_tok_template
    ours = encode_conversations(tok, [c.messages for c in convs[:n]], eot)
    cols = trainer.train_dataset.column_names
    key = next((k for k in ("labels", "assistant_masks", "completion_mask") if k in cols), None)
    if key is None:
        return trainer, {**extra, "trl_same_tokens_and_mask": f"not checked: no mask column in TRL's dataset ({cols})"}
    same = 0
    for (ids, labels), row in zip(ours, trainer.train_dataset.select(range(n))):
        mask = [int(x != IGNORE_INDEX) for x in labels][:a.max_length]
        theirs = [int(x != IGNORE_INDEX) for x in row[key]] if key == "labels" else list(row[key])  # trl 1.16: labels
        same += row["input_ids"] == ids[:a.max_length] and theirs == mask
    return trainer, {**extra, "trl_same_tokens_and_mask": f"{same}/{n}"}


# ------------------------------------------------------------------------------------------- LLaMA-Factory

def llamafactory_config(a, data_dir: str, out_dir: str) -> dict:
    """LLaMA-Factory 0.9.5's training arguments (its YAML keys) for the same run as ours: LoRA r / 2r / 0.05 on
    every linear layer but the head, ``cutoff_len`` = max length, ``neat_packing`` (packing with block-diagonal
    attention: documents never see each other), ``a.packing_batch`` packed rows per micro batch, AdamW with a
    linear schedule and no warm-up, no gradient checkpointing (LLaMA-Factory turns it on unless told not to),
    no saving. ``data_dir`` holds ``dataset_info.json`` and ``chitchat.jsonl`` (:func:`write_llamafactory_data`);
    ``out_dir`` must not exist yet (LLaMA-Factory refuses a non-empty output folder)."""
    return {
        "model_name_or_path": a.model, "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "lora_rank": a.lora_r, "lora_alpha": 2 * a.lora_r, "lora_dropout": 0.05, "lora_target": "all",
        "dataset": "chitchat", "dataset_dir": data_dir, "template": a.llamafactory_template,
        "cutoff_len": a.max_length, "packing": True, "neat_packing": True, "preprocessing_num_workers": 1,
        "overwrite_cache": True, "output_dir": out_dir, "per_device_train_batch_size": a.packing_batch,
        "gradient_accumulation_steps": 1, "learning_rate": 2e-4, "lr_scheduler_type": "linear", "warmup_steps": 0,
        "weight_decay": 0.0, "optim": "adamw_torch", **run_length(a), "logging_steps": 1,
        "save_strategy": "no", "report_to": "none", "bf16": bool(a.bf16), "seed": 0, "disable_tqdm": True,
        "disable_gradient_checkpointing": True, "flash_attn": "sdpa", "dataloader_num_workers": 0,
        "plot_loss": False, "ddp_timeout": 180000000, "use_cpu": not a.cuda,
    }


def write_llamafactory_data(a, data_dir: str) -> None:
    """The same conversations as ours (after our validation) in LLaMA-Factory's sharegpt layout with OpenAI-style
    role/content messages, and its ``dataset_info.json``."""
    from sft.data.records.records import load_conversations

    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "chitchat.jsonl"), "w", encoding="utf-8") as f:
        for c in load_conversations(a.data, "error"):
            f.write(json.dumps({"messages": c.messages}) + "\n")
    info = {"chitchat": {"file_name": "chitchat.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
                         "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                  "assistant_tag": "assistant", "system_tag": "system"}}}
    with open(os.path.join(data_dir, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f)


def run_llamafactory(a, json_path: str, log) -> subprocess.CompletedProcess | str:
    """Run LLaMA-Factory in a fresh process of its own virtual environment; its result lands in ``json_path.0``.
    Returns the finished process, or a one-line reason it could not start."""
    if not os.path.exists(LF_PYTHON):
        return f"not installed: run `bash bench/setup_llamafactory.sh` (creates {os.path.relpath(LF_PYTHON, ROOT)})"
    work = os.path.dirname(json_path)
    data_dir = os.path.join(work, "llamafactory-data-" + os.path.splitext(os.path.basename(a.data))[0])
    if not os.path.exists(os.path.join(data_dir, "dataset_info.json")):
        write_llamafactory_data(a, data_dir)
    tag = os.path.basename(json_path)[:-len(".json")]
    out_dir = os.path.join(work, f"llamafactory-out-{tag}")
    cfg_path = os.path.join(work, f"{tag}.yaml.json")
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(llamafactory_config(a, data_dir, out_dir), f, indent=1)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TOKENIZERS_PARALLELISM="false", DISABLE_VERSION_CHECK="1", PYTHONNOUSERSITE="1")
    cmd = [LF_PYTHON, LF_WORKER, "--config", cfg_path, "--json", f"{json_path}.0", "--timing",
           getattr(a, "timing", "steps")]
    return subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=3600)


def llamafactory_version() -> str:
    if not os.path.exists(LF_PYTHON):
        return "not installed"
    p = subprocess.run([LF_PYTHON, "-c", "import importlib.metadata as m; print(m.version('llamafactory'))"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONNOUSERSITE": "1"})
    return p.stdout.strip() or f"unknown ({p.stderr.strip().splitlines()[-1:]})"


if __name__ == "__main__":
    sys.exit("bench/compare_peers.py is imported by bench/compare.py; run that")
