"""The parsed flags turned into the wings' spec objects, in one place that ``sft-train`` and ``sft-check`` share:
the data sources, the data preparation (:class:`sft.data.spec.PreparationSpec`), the chat template's control tokens,
the model's loading (:class:`sft.model.spec.LoadSpec`) and its LoRA adapter (:class:`sft.model.spec.LoraSpec`).
The wings never read the flags themselves.
"""
from __future__ import annotations

from typing import Optional

from sft.data.spec import PreparationSpec
from sft.data.template.chat import chat_control_tokens
from sft.errors import ConfigError
from sft.model.loading import torch_dtype
from sft.model.spec import LoadSpec, LoraSpec


def data_sources(data_args) -> dict[str, list[str]]:
    """``{"train": [--data_path sources], "eval": [--eval_data_path] or []}``; with ``--eval_split_ratio`` (and no
    ``--eval_data_path``) ``"eval"`` is the ``--data_path`` sources too, of which
    :func:`sft.app.train.load_records` keeps the held-out records."""
    train = data_args.data_path
    train = [train] if isinstance(train, str) else list(train or [])
    split = train if data_args.eval_split_ratio is not None else []
    return {"train": train, "eval": [data_args.eval_data_path] if data_args.eval_data_path else split}


def control_tokens_for(tok, system_message: Optional[str]) -> list[str]:
    """The chat template's control tokens (refused in every text of the data).

    Raises:
        ConfigError: ``system_message`` holds one.
    """
    control = chat_control_tokens(tok)
    found = [t for t in control if t in (system_message or "")]
    if found:
        raise ConfigError([f"--system_message contains the control token(s) {', '.join(found)}; remove them (they "
                           "would become real chat-template tokens in every sample)"])
    return control


def preparation_spec(data_args, training_args) -> PreparationSpec:
    """The run's data preparation settings from the parsed flags (see :class:`sft.data.spec.PreparationSpec` for
    each field): ``--model_max_length``, ``--system_message``, ``--on_bad_record``, ``--lazy_preprocess``,
    ``--long_conversations`` (as resolved), ``--data_cache_dir``, ``--preprocessing_num_workers``,
    ``--data_weights``, ``--data_seed`` (else ``--seed``), ``--data_timeout``, ``--eval_split_ratio``,
    ``--eval_split_seed``, ``--mask_history`` and ``--allow_dropped_content``."""
    weights = data_args.data_weights
    return PreparationSpec(
        max_len=training_args.model_max_length, system_message=data_args.system_message,
        on_bad_record=data_args.on_bad_record, lazy=data_args.lazy_preprocess,
        long_conversations=data_args.long_conversations_mode, cache_dir=data_args.data_cache_dir,
        num_proc=data_args.preprocessing_num_workers, weights=tuple(weights) if weights is not None else None,
        seed=training_args.data_seed if training_args.data_seed is not None else training_args.seed,
        data_timeout=data_args.data_timeout, eval_split_ratio=data_args.eval_split_ratio,
        eval_split_seed=data_args.eval_split_seed, last_reply_only=data_args.mask_history,
        allow_dropped_content=data_args.allow_dropped_content)


def load_spec(model_args, training_args, lora_args) -> LoadSpec:
    """How the base model loads: the training dtype (``--bf16`` as agreed / ``--fp16``), ``--trust_remote_code``,
    ``--cache_dir``, ``--q_lora``, ``--gradient_checkpointing`` as given (peft's k-bit preparation reads it), and
    straight onto a CUDA device unless DeepSpeed or FSDP places the model."""
    return LoadSpec(dtype=torch_dtype(training_args.bf16, training_args.fp16),
                    trust_remote_code=model_args.trust_remote_code, cache_dir=training_args.cache_dir,
                    quantize_4bit=lora_args.q_lora,
                    activation_checkpointing=bool(training_args.activation_checkpointing),
                    activation_checkpointing_kwargs=training_args.activation_checkpointing_kwargs,
                    load_on_device=not (training_args.deepspeed or training_args.fsdp))


def lora_spec(model_args, lora_args) -> LoraSpec:
    """The LoRA adapter of ``--lora_r --lora_alpha --lora_dropout --lora_target_modules --lora_router --lora_bias
    --train_embeddings``."""
    targets = lora_args.lora_target_modules
    return LoraSpec(r=lora_args.lora_r, alpha=lora_args.lora_alpha, dropout=lora_args.lora_dropout,
                    target_modules=tuple(targets) if targets else None, router=lora_args.lora_router,
                    bias=lora_args.lora_bias,
                    train_embeddings=model_args.train_embeddings)
