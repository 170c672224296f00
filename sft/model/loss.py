"""The LM head and the cross-entropy loss only at supervised positions (``--lm_head_supervised_only``).

A causal LM's forward projects every position's hidden state onto the vocabulary (``[tokens, vocab]`` logits,
upcast to fp32 by transformers' loss) although only the positions whose shifted label is not -100 enter the
loss. Here the model runs as usual but keeps no logits (``logits_to_keep`` = an all-False mask, so its own
``lm_head`` sees ``[0, hidden]``), returns its last hidden state, and the head plus the loss run on the
supervised positions only, in chunks of at most :data:`MAX_LOGIT_ELEMENTS` logits: above that size each chunk's
logits are recomputed in backward (``torch.utils.checkpoint``) instead of kept, so memory does not grow with
vocabulary x tokens. The result is the loss transformers computes (``ForCausalLMLoss``: the sum of the
per-token cross entropies in fp32 over the shifted labels, divided by ``num_items_in_batch`` when given, else
their mean), with the same gradients up to float rounding.

The head is called as the module ``model.get_output_embeddings()``, so a LoRA adapter on it, a tied embedding
and DeepSpeed ZeRO-3's parameter gathering (a module pre-forward hook) all apply as in the model's own forward.
The model is called through its wrapper (DDP / DeepSpeed engine), so gradient synchronisation is unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch

IGNORE_INDEX = -100

# 2**27 fp32 logits = 512 MiB per chunk (its softmax in the loss's backward doubles that, transiently): 880
# positions at Qwen's 152k vocabulary, 2730 at SmolLM2's 49k. A micro batch within it runs as one chunk with no
# recomputation (the FLOPs of transformers' own logits_to_keep path).
MAX_LOGIT_ELEMENTS = 2 ** 27

# CausalLM classes whose forward is ``logits = self.lm_head(hidden_states)`` then ``self.loss_function`` with
# nothing in between (checked in transformers 5.24's modeling files); the mixture-of-experts ones then add
# ``router_aux_loss_coef * aux_loss`` when labels are given, an aux loss they return without labels too
# (``output_router_logits=True``), which sft adds itself (sft/model/routing.py). Others (Gemma 2's logit
# soft-capping, Cohere's and Granite's logit scaling, remote code) keep the full path.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "olmo2", "smollm3",
                                    "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "mixtral", "gpt_oss",
                                    "deepseek_v3"})


def shifted_labels(inputs: dict) -> torch.Tensor:
    """The next-token targets of a batch, ``[batch, seq]`` int64: ``inputs["shift_labels"]`` when the collator gives
    them, else ``labels[..., 1:]`` padded with -100 at the end (what ``ForCausalLMLoss`` does)."""
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"]
    labels = inputs["labels"]
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def supports_supervised_head(model) -> bool:
    """Whether ``model`` (a transformers causal LM, possibly inside a peft wrapper) has a plain LM head
    (:data:`PLAIN_HEAD_MODEL_TYPES`) and an output embedding module to call."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES
            and getattr(model, "get_output_embeddings", lambda: None)() is not None)



def use_supervised_head(model, requested: bool, fsdp: bool) -> bool:
    """Whether training runs the LM head and loss at supervised positions only: ``--lm_head_supervised_only``
    (``requested``), a model with a plain LM head (:func:`supports_supervised_head`), and not under FSDP2, whose
    head module runs outside the root module's forward, where FSDP2 has resharded its weight again (a 2-process FSDP2
    run died with SIGSEGV); FSDP keeps the full path. The one decision the Trainer, the memory plan and the
    throughput figures follow."""
    return bool(requested) and not fsdp and supports_supervised_head(model)

def _chunk_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    logits = head(hidden).float()  # fp32 as transformers' ForCausalLMLoss
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


def supervised_lm_loss(hidden: torch.Tensor, shift_labels: torch.Tensor, head: torch.nn.Module,
                       num_items_in_batch=None, max_logit_elements: int = MAX_LOGIT_ELEMENTS) -> torch.Tensor:
    """Cross entropy of ``head(hidden)`` at the positions where ``shift_labels != -100``.

    Args:
        hidden: ``[batch, seq, hidden]`` last hidden states (after the final norm), any float dtype.
        shift_labels: ``[batch, seq]`` int64 next-token targets, -100 where not supervised.
        head: the LM head module (``[*, hidden] -> [*, vocab]``), called on chunks of supervised positions.
        num_items_in_batch: the number of supervised targets the Trainer normalises by (across gradient
            accumulation and, with ``average_tokens_across_devices``, ranks); ``None``: the mean over this batch.
        max_logit_elements: logits held at once (positions x vocabulary); more positions than that are split into
            chunks whose logits are recomputed in backward.

    Returns:
        A scalar fp32 tensor: the summed cross entropy / ``num_items_in_batch`` (or the mean; NaN for a batch with
        no supervised target, as ``torch.nn.functional.cross_entropy``).
    """
    flat = shift_labels.reshape(-1).to(hidden.device)
    where = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    states = hidden.reshape(-1, hidden.shape[-1])
    if where.numel() == 0:
        # Keep the head and the body in the graph (a zero gradient), as the full computation does, so that DDP
        # and ZeRO see every parameter take part.
        total = _chunk_loss_sum(states[:1], flat[:1].clamp(min=0), head) * 0.0
    else:
        states, targets = states.index_select(0, where), flat.index_select(0, where)
        vocab = int(getattr(head, "out_features", 0) or head.weight.shape[0])
        chunk = max(1, max_logit_elements // max(1, vocab))
        if states.shape[0] <= chunk:
            total = _chunk_loss_sum(states, targets, head)
        else:
            from torch.utils.checkpoint import checkpoint

            total = sum(checkpoint(_chunk_loss_sum, states[i:i + chunk], targets[i:i + chunk], head,
                                   use_reentrant=False)
                        for i in range(0, states.shape[0], chunk))
    if num_items_in_batch is None:
        return total / torch.tensor(float(where.numel()), device=total.device)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def compute_supervised_loss(model, inputs: dict, num_items_in_batch=None, head: Optional[torch.nn.Module] = None,
                            max_logit_elements: int = MAX_LOGIT_ELEMENTS, return_outputs: bool = False,
                            **forward_kwargs):
    """One forward of ``model`` (the Trainer's possibly wrapped model) on ``inputs`` without logits, then
    :func:`supervised_lm_loss` with the unwrapped model's output embedding ``head``. ``inputs`` keeps its
    ``labels`` / ``shift_labels``; the model is called without them (so a mixture-of-experts model adds no aux loss
    of its own), with ``forward_kwargs`` (e.g. ``output_router_logits=True``: its ``aux_loss`` in the outputs).
    Returns the scalar fp32 loss, or ``(loss, model outputs)`` with ``return_outputs``."""
    targets = shifted_labels(inputs)
    model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}
    keep_none = torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
    out = model(**model_inputs, **forward_kwargs, logits_to_keep=keep_none, output_hidden_states=True,
                use_cache=False)
    loss = supervised_lm_loss(out.hidden_states[-1], targets, head, num_items_in_batch, max_logit_elements)
    return (loss, out) if return_outputs else loss
