"""Load tokenizer and model; apply LoRA (peft)."""
from __future__ import annotations

import logging
from typing import Optional

import torch
import transformers

from sft.compat.peft import register_custom_lora_layer, without_gptqmodel, without_v4_moe_conversion
from sft.data.template.chat import ENDOFTEXT, chat_token_ids, ensure_chat_template
from sft.data.template.chat_template import parse_template_kwargs, with_template_kwargs
from sft.data.template.end_tokens import end_of_turn_id, model_end_ids
from sft.data.vocab import special_only_size
from sft.errors import SFTError, explain_load_errors
from sft.logs import release_import_notices
from sft.model.architecture import auto_class_of, freeze_non_text, inside_text, linear_names_outside_text
from sft.model.expert_lora import ExpertLoraWrapper, nest_in_declared_order
from sft.model.experts import (
    choose_targets,
    count_by_kind,
    describe_candidates,
    four_bit_values,
    lora_candidates,
    peft_targets,
    quantize_experts,
    summary,
)
from sft.model.quantized import loading_fix, model_folder, read_quantization
from sft.model.spec import LoadSpec, LoraSpec

logger = logging.getLogger(__name__)

# A row of the embedding matrix whose largest |value| is at most this was never trained (it is still
# zero). Convention from unsloth's fix_untrained_tokens (max over the row compared with a small eps).
UNTRAINED_ROW_ABS_MAX = 1e-8


def load_tokenizer(path: str, trust_remote_code: bool = False, cache_dir: Optional[str] = None,
                   chat_template: Optional[str] = None, chat_template_kwargs: Optional[str] = None):
    """Load the tokenizer of the model folder (or cached hub id) ``path``, give it a chat template (ChatML
    fallback) and a pad token. ``cache_dir``: transformers' ``cache_dir`` for ``from_pretrained``;
    ``chat_template``: a Jinja file whose template replaces the tokenizer's own (``--chat_template``);
    ``chat_template_kwargs``: ``--chat_template_kwargs``' JSON object, written into the template as defaults
    (:func:`sft.data.template.chat_template.with_template_kwargs`).

    Returns:
        ``(tokenizer, eot_id, added_tokens)``; ``added_tokens`` is True when the vocabulary grew.

    Raises:
        SFTError: the tokenizer is not a fast (``tokenizers``) tokenizer, which offsets require; or
            ``chat_template_kwargs`` is not a JSON object of variable names.
    """
    with explain_load_errors("tokenizer", path, "the folder needs tokenizer.json (a fast tokenizer) and "
                             "tokenizer_config.json, as save_pretrained writes them"):
        tok = transformers.AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, cache_dir=cache_dir,
        )  # no model_max_length here: truncation is ours (counted and reported), not the tokenizer's
    require_vocabulary(tok, path, "copy tokenizer.json and tokenizer_config.json from the model it was made from "
                       "into the folder (save_pretrained writes them)")
    if not getattr(tok, "is_fast", False):
        raise SFTError(f"{path}: the tokenizer is not a fast (tokenizers) tokenizer; "
                       "labels need token offsets: save the tokenizer with tokenizer.json")
    tok.padding_side = "right"
    if chat_template:
        tok.chat_template = read_chat_template(chat_template)
    with explain_load_errors("tokenizer", path, "the tokenizer does not behave like a transformers tokenizer"):
        added = ensure_chat_template(tok)
    if chat_template_kwargs:
        tok.chat_template = with_template_kwargs(tok.chat_template, template_kwargs(chat_template_kwargs))
    eot = end_of_turn_id(tok, model_end_ids(path))  # the model's end tokens: evidence of where a reply ends
    added = choose_pad_token(tok, eot) or added
    return tok, eot, added


def template_kwargs(text: str) -> dict:
    """``--chat_template_kwargs``' JSON object (:func:`sft.data.template.chat_template.parse_template_kwargs`).

    Raises:
        SFTError: naming the flag, the value and what is wrong.
    """
    try:
        return parse_template_kwargs(text)
    except ValueError as e:
        raise SFTError(f"--chat_template_kwargs {text}: {e}; give a JSON object of the template's variables") \
            from None


def read_chat_template(path: str) -> str:
    """The text of the chat template file ``path`` (``--chat_template``), checked to compile.

    Raises:
        SFTError: the file cannot be read, or is not a Jinja template (jinja2's reason quoted).
    """
    import jinja2

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SFTError(f"--chat_template {path}: cannot read it ({e.strerror}); give a Jinja file") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise SFTError(f"--chat_template {path}: not a Jinja template (line {e.lineno}: {e.message})") from None
    if not text.strip():
        raise SFTError(f"--chat_template {path}: the file is empty; give a Jinja chat template")
    return text


def require_vocabulary(tok, path: str, fix: str) -> None:
    """Refuse a tokenizer with nothing but special tokens: transformers 5 builds one, without an error, from a
    model folder that has a config.json but no tokenizer files.

    Raises:
        SFTError: naming ``path`` and ``fix``.
    """
    if (size := special_only_size(tok)) is not None:
        raise SFTError(f"{path}: cannot load the tokenizer: the folder has no tokenizer files (no tokenizer.json, "
                       f"vocabulary or tokenizer model; it loads as {size} special token(s) only); {fix}")


def choose_pad_token(tok, eot_id: int) -> bool:
    """Make sure the pad token exists and is not the end-of-turn token (which is supervised).

    Padding is masked by position, so the pad id never reaches the loss; a distinct pad token still
    keeps generation and any id-based masking elsewhere from confusing padding with ``<|im_end|>``.

    Returns:
        True if a new token had to be added to the vocabulary.
    """
    if tok.pad_token_id is not None and tok.pad_token_id != eot_id:
        return False
    before = tok.pad_token
    vocab = tok.get_vocab()
    for cand in (ENDOFTEXT, tok.unk_token, tok.eos_token, tok.bos_token):
        if cand and cand in vocab and vocab[cand] != eot_id:
            tok.pad_token = cand
            logger.info("pad token: %r (id %d) (was %r; it must not be the end-of-turn token)", cand, vocab[cand],
                        before)
            return False
    tok.add_special_tokens({"pad_token": "<|pad|>"})
    logger.warning("pad token: added '<|pad|>' (id %d); no existing token could serve", tok.pad_token_id)
    return True


def torch_dtype(bf16: bool = False, fp16: bool = False) -> torch.dtype:
    """The training dtype of the precision flags: bfloat16, float16 or float32."""
    if bf16:
        return torch.bfloat16
    if fp16:
        return torch.float16
    return torch.float32


def gathered(*params):
    """Context manager: under DeepSpeed ZeRO-3, the full tensors of ``params`` (read-only); else a no-op."""
    import contextlib

    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)


def embedding_rows(model) -> int:
    """Number of rows of the input embedding matrix. Under ZeRO-3 a rank's ``weight.shape`` is the empty
    placeholder left by partitioning; DeepSpeed keeps the full shape in ``ds_shape``."""
    weight = model.get_input_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def chat_tokens_are_new(model, tok, vocab_grew: bool) -> tuple[bool, str]:
    """Decide from the tokenizer and the weights whether the chat template's special tokens are untrained.

    New when an id is outside the model's embedding matrix, or its row is all (near) zero
    (see :data:`UNTRAINED_ROW_ABS_MAX`). Returns ``(new, reason)``.
    """
    ids = chat_token_ids(tok)
    emb = model.get_input_embeddings().weight
    with gathered(emb), torch.no_grad():  # under ZeRO-3 each rank holds a shard only
        if vocab_grew or any(i >= embedding_rows(model) for i in ids):
            return True, "the tokenizer has tokens the model's embedding matrix lacks"
        rows = emb[torch.tensor(ids)].float().abs().amax(dim=1)
    untrained = [tok.convert_ids_to_tokens(i) for i, r in zip(ids, rows.tolist()) if r <= UNTRAINED_ROW_ABS_MAX]
    if untrained:
        return True, f"embedding rows of {untrained} are untrained (all zero)"
    return False, f"chat tokens {tok.convert_ids_to_tokens(ids)} have trained embeddings"


def quantization_kwargs(compute_dtype: torch.dtype, device: torch.device) -> dict:
    """``from_pretrained`` kwargs for Q-LoRA: bitsandbytes 4-bit NF4 with double quantization.

    ``compute_dtype`` follows the precision flags (bf16 / fp16 / fp32; fp32 on CPU, where bitsandbytes' bf16
    kernels are far slower). ``device_map`` puts the whole model on this process's own ``device``: under
    torchrun each rank loads its own replica (``{"": local_rank}`` on GPU), never ``"auto"`` sharding.
    """

    release_import_notices("bitsandbytes")
    q = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    return {"quantization_config": q, "device_map": {"": device.index if device.type == "cuda" else str(device)}}


def pre_quantized_kwargs(q, config, device: torch.device) -> dict:
    """``from_pretrained`` kwargs for a pre-quantized base ``q`` (:class:`sft.model.quantized.Quantization`): loaded as
    saved, never quantized again; ``device_map`` = this process's own ``device`` (as for Q-LoRA).

    A GPTQ base on CPU is given gptqmodel's ``torch`` kernel (``config.quantization_config["backend"]``):
    gptqmodel's default CPU kernel (``TorchAtenLinear``, checked against gptqmodel 7.6.0) fixes its path at the
    first forward, dequantized fp32 weights when called with gradients and an int4 kernel with bf16 scales
    otherwise, so a reloaded adapter would not give the trained logits (0.04 apart on the test model);
    ``TorchLinear`` dequantizes the same way in training and evaluation. On GPU gptqmodel chooses.
    """
    if q.method == "gptq" and device.type == "cpu":
        config.quantization_config = {**config.quantization_config, "backend": "torch"}
    return {"config": config, "device_map": {"": device.index if device.type == "cuda" else str(device)}}


def load_model(path: str, tok, vocab_grew: bool, spec: LoadSpec = LoadSpec(), device: Optional[torch.device] = None):
    """Load ``AutoModelForCausalLM`` from ``path`` in ``dtype`` (on a CUDA ``device`` with ``load_on_device``: straight
    onto it, as the Trainer would place it; not under DeepSpeed or FSDP, which place it themselves; with
    ``quantize_4bit``: a 4-bit NF4 base on
    ``device``, or, when the folder is pre-quantized (GPTQ, bitsandbytes 4-bit; :mod:`sft.model.quantized`), the base
    as saved; then prepared for k-bit training); resize the embeddings if the vocabulary grew.

    ``spec`` says how (:class:`LoadSpec`); ``device``: this process's device (default CPU). Under DeepSpeed,
    :func:`sft.distributed.process_group.start_runtime` must have run first (ZeRO-3 builds the model partitioned).
    Returns ``(model, vocab_grew)``.

    Raises:
        SFTError: the folder cannot be loaded (the library's one-line reason is quoted, with the fix for a plain or
            a pre-quantized folder).
    """

    folder = model_folder(path)
    q = read_quantization(folder) if folder else None
    device = device or torch.device("cpu")
    fix = loading_fix(q) or ("the folder needs a valid config.json of a causal LM and its weights "
                             "(model.safetensors), as save_pretrained writes them")
    with explain_load_errors("model", path, fix):
        extra = {}
        if spec.quantize_4bit and q is not None:
            config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code,
                                                             cache_dir=spec.cache_dir)
            extra = pre_quantized_kwargs(q, config, device)
        elif spec.quantize_4bit:
            extra = quantization_kwargs(spec.dtype, device)
        elif device.type == "cuda" and spec.load_on_device:
            # straight into the training dtype on this process's GPU: no full copy in host memory first
            extra = {"device_map": {"": device.index if device.index is not None else torch.cuda.current_device()}}
        auto = auto_class_of(path, trust_remote_code=spec.trust_remote_code, cache_dir=spec.cache_dir)
        model = auto.from_pretrained(
            path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code, cache_dir=spec.cache_dir, **extra,
        )
    if spec.quantize_4bit and extra:
        from peft import prepare_model_for_kbit_training

        experts = quantize_experts(model) if q is None else 0  # bitsandbytes' loading quantized nn.Linear only
        four, total = four_bit_values(model)
        logger.info("Q-LoRA base: %s of %s parameters stored 4-bit NF4 (routed experts: %s)", f"{four:,}",
                    f"{total:,}", f"{experts:,}")

        # fp32 layer norms and lm_head, frozen base, input grads for checkpointing (peft's Q-LoRA recipe)
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(spec.activation_checkpointing),
            gradient_checkpointing_kwargs=spec.activation_checkpointing_kwargs)
    if len(tok) > embedding_rows(model):
        model.resize_token_embeddings(len(tok), mean_resizing=True)
        vocab_grew = True
    freeze_non_text(model)  # a multimodal checkpoint trained on text: its vision tower stays as it was
    model.config.use_cache = False  # the KV cache is useless in training and conflicts with checkpointing
    model.config.pad_token_id = tok.pad_token_id  # the choice made in choose_pad_token
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, vocab_grew


def _module_name(model, module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name.split(".")[-1]
    raise SFTError("cannot find the embedding module by name")


def _quant_linears(model) -> list:
    """gptqmodel's quantized linear modules of ``model`` (empty without gptqmodel or on a model not quantized with
    GPTQ; gptqmodel is imported only for a GPTQ model, since importing it prints a banner and sets variables)."""
    qc = getattr(model.config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if str(getattr(method, "value", method)).lower() != "gptq":
        return []
    try:
        from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, BaseQuantLinear)]


def apply_lora(model, tok, vocab_grew: bool, spec: LoraSpec = LoraSpec(), activation_checkpointing: bool = False):
    """Wrap ``model`` in a peft LoRA model as ``spec`` says (:class:`LoraSpec`). Base weights are frozen; only
    adapters (and, when the chat tokens are new or ``spec.train_embeddings == "true"``, the embeddings and lm_head)
    are trained. What is adapted follows :mod:`sft.model.experts`: by default attention, every routed expert's
    projections (3-D parameters, computed by :mod:`sft.model.expert_lora` without rebuilding them), shared experts
    and dense MLPs; routers only with ``spec.router``. The log line names each kind and its trainable count.

    Raises:
        SFTError: a target name the model lacks (what exists is listed by kind), or a router named without
            ``spec.router``.
    """
    from peft import LoraConfig, get_peft_model

    mode = spec.train_embeddings
    if mode == "auto":
        train_emb, reason = chat_tokens_are_new(model, tok, vocab_grew)
        logger.info("train embeddings: %s (auto: %s)", train_emb, reason)
    else:
        train_emb = mode == "true"
        logger.info("train embeddings: %s (--train_embeddings %s)", train_emb, mode)
    modules_to_save = None
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if train_emb:
        modules_to_save = [_module_name(model, model.get_input_embeddings())]
        out = model.get_output_embeddings()
        if out is not None:
            modules_to_save.append(_module_name(model, out))
    quant = {id(m) for m in _quant_linears(model)}
    candidates = lora_candidates(model, lambda m: isinstance(m, torch.nn.Linear) or id(m) in quant)
    candidates = inside_text(model, candidates)  # a vision tower and merger: never a LoRA candidate
    chosen = choose_targets(candidates, spec.target_modules, spec.router)
    target_modules, target_parameters = peft_targets(model, chosen)
    if not target_modules and not target_parameters:
        raise SFTError(f"--lora_target_modules {' '.join(spec.target_modules or ['all-linear'])}: nothing to adapt; "
                       + describe_candidates(candidates))
    config = LoraConfig(
        r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
        target_modules=target_modules, target_parameters=target_parameters, bias=spec.bias,
        task_type="CAUSAL_LM", modules_to_save=modules_to_save,
        ensure_weight_tying=bool(train_emb and tied),
        exclude_modules=linear_names_outside_text(model) or None,  # a vision tower: never adapted
    )
    holders = [model.get_submodule(t.path.rpartition(".")[0]) for t in chosen if t.parameter]
    if holders:
        register_custom_lora_layer(config, {cls: ExpertLoraWrapper for cls in {type(h) for h in holders}})
    if activation_checkpointing:
        model.enable_input_require_grads()
    try:
        with without_gptqmodel(not _quant_linears(model)), without_v4_moe_conversion():
            model = get_peft_model(model, config)
    except ValueError as e:
        raise SFTError(f"--lora_target_modules {' '.join(spec.target_modules or ['all-linear'])}: "
                       f"{str(e).splitlines()[0][:200]}; {describe_candidates(candidates)}") from None
    if any(hasattr(h, "parametrizations") for h in holders):  # 4-bit experts: peft nests their wrappers otherwise
        nest_in_declared_order(model)
    if target_parameters and spec.dropout:
        # peft refuses to build (and load) a parameter adapter whose config names a dropout; the experts' dropout
        # lives in their layers (ExpertLoraWrapper), and adapter_config.json records 0 so that peft loads it
        model.peft_config["default"].lora_dropout = 0.0
    hooked = keep_lora_inputs_in_autocast_dtype(model)
    trainable, total = model.get_nb_trainable_parameters()
    routers = [t.name for t in candidates if t.kind == "router"]
    logger.info("LoRA r=%d alpha=%d dropout=%.3g: %s: %d trainable of %d parameters (%.3f%%)",
                spec.r, spec.alpha, spec.dropout, summary(chosen, count_by_kind(model, chosen), routers),
                trainable, total, 100.0 * trainable / total)
    logger.debug("LoRA inputs stay in the autocast dtype in %d layers", hooked)
    return model


def _lora_input_cast(module, args) -> None:
    """Forward pre-hook of a LoRA layer: peft casts the layer's input to the adapter's dtype (fp32); skipped where
    that changes nothing: autocast on in the input's dtype (it casts back to that dtype before the adapter's matmul:
    x bf16 -> fp32 -> bf16, exact both ways) and the layer's dropout inactive (p = 0 or eval mode). An active
    dropout keeps the cast: bf16 dropout on CPU scales by 1/(1-p) rounded to bf16 (1.0547 for p = 0.05, not
    1.0526), fp32 dropout then one rounding does not. A forward outside autocast also keeps peft's cast."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor):
        kind = x.device.type
        try:
            same = torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == x.dtype
        except (RuntimeError, ValueError):  # a device type autocast does not know (meta)
            same = False
        quiet = all(not d.training or getattr(d, "p", 0) == 0 for d in module.lora_dropout.values())
        module.cast_input_dtype_enabled = not (same and quiet)


def keep_lora_inputs_in_autocast_dtype(model) -> int:
    """Hook every LoRA layer of ``model`` so that, under autocast (``--bf16`` / ``--fp16`` outside DeepSpeed),
    its input (micro-batch tokens x hidden size, bf16) is not copied to fp32 and back where that is exact
    (:func:`_lora_input_cast`: ``--lora_dropout 0``, or evaluation): two full-size casts per targeted linear per
    forward and two more in backward, ~800 copies a step at 30 layers x 7 projections. The adapter weights stay fp32
    (the optimizer's master copy; autocast casts the small ``r x hidden`` matrices):
    ``tests/unit/model/test_lora_precision.py`` checks loss and gradients bitwise equal to peft's casting. Uses peft's
    ``cast_input_dtype_enabled`` switch (peft >= 0.15, ``peft.helpers.disable_input_dtype_casting``), set per call by
    :func:`_lora_input_cast`.

    Returns:
        The number of layers hooked.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and hasattr(m, "lora_A")]
    for m in layers:
        m.register_forward_pre_hook(_lora_input_cast)
    return len(layers)


def generation_config_for(model, tok, eot_id: int) -> transformers.GenerationConfig:
    """The model's generation config with EOS = [end-of-turn, original EOS ...] and the chosen pad token."""
    base = getattr(model, "generation_config", None) or transformers.GenerationConfig()
    gc = transformers.GenerationConfig.from_dict(base.to_dict())
    eos = gc.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    gc.eos_token_id = [eot_id] + [e for e in eos if e != eot_id]
    gc.pad_token_id = tok.pad_token_id
    return gc
