"""Attention over the whole row when each rank holds 1/N of it (``--sequence_parallel_size N``).

Every rank of a sequence-parallel group (:mod:`sft.distributed.sequence_parallel`) runs the model on its own slice of
the micro batch's one row (:class:`sft.data.batches.packing.SequenceParallelSplit`): embeddings, MLPs, norms, the LM
head and the loss see only the slice, so their activations are 1/N of the row's. Attention must see the whole row; two
ways, both registered with transformers' ``AttentionInterface`` and both keeping every document of a padding-free or
packed row apart (the per-document boundaries ``cu_seq_lens_q`` describe the whole row on every rank):

* ``ulysses`` (:data:`SP_ULYSSES`): DeepSpeed's ``UlyssesSPAttentionHF`` (``deepspeed.runtime.sequence_parallel.
  ulysses_sp``, DeepSpeed 0.19.8; arXiv 2309.14509): an all-to-all turns ``[slice, all heads]`` into ``[whole row,
  heads / N]``, :func:`sft.model.attention.packed_attention_forward` runs on the whole row (one varlen kernel call
  per layer on CUDA, as without sequence parallelism), and a second all-to-all gives each rank its slice back.
  Needs the attention heads divisible by N and the KV heads divisible by N (or N by them: DeepSpeed replicates them).
* ``all_gather`` (:data:`SP_ALL_GATHER`, written here: neither DeepSpeed nor torch has it for padding-free rows):
  each rank keeps its queries and gathers the row's keys and values (``torch.distributed.nn.functional.all_gather``,
  whose backward sums the gradients back to their owners), then attends per document, causally, with its queries'
  global positions -- the context parallelism of Llama 3 (arXiv 2407.21783, section 3.3.2), chosen there because it
  works with any number of heads and with document masks. torch's own context parallelism
  (``torch.distributed.tensor.experimental.context_parallel``) shards one causal sequence per row for SDPA and
  cannot keep a padding-free row's documents apart. Keys and values of the whole row are held during the layer's
  attention (with GQA a fraction of the hidden states: SmolLM2-135M's 3 KV heads x 64 = 192 values per token against
  576); the attention runs causal SDPA once per document piece, without a mask (its memory stays linear in the
  length). A piece that starts inside its document is computed from the document's first row with placeholder
  queries before its own, whose rows are dropped: SDPA's causal form cannot offset the queries, so a later rank
  spends the attention FLOPs of the document's earlier part once more (the cost of keeping the memory linear).

:func:`use_sequence_parallel_attention` switches a model to one of them.
"""
from __future__ import annotations

import logging

import torch

from sft.distributed.sequence_parallel import SequenceParallel
from sft.errors import ConfigError
from sft.model.attention import PACKED_ATTENTION, bounds_from_cu_seqlens, packed_attention_forward, packed_mask

logger = logging.getLogger(__name__)

SP_ULYSSES = "sft_sp_ulysses_sdpa"  # "sdpa" in the names: transformers checks that the model supports SDPA
SP_ALL_GATHER = "sft_sp_all_gather_sdpa"
MODES = ("auto", "ulysses", "all_gather")


def head_counts(config) -> tuple[int, int, int, int]:
    """``(attention heads, KV heads, head dim, layers)`` of a transformers config (its text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return heads, kv, dim, int(text.num_hidden_layers)


def ulysses_problem(heads: int, kv_heads: int, size: int) -> str | None:
    """Why Ulysses cannot split these heads over ``size`` ranks, or None when it can."""
    if heads % size:
        return f"{heads} attention heads are not divisible by {size}"
    if kv_heads % size and size % kv_heads:
        return f"{kv_heads} KV heads neither divide nor are divisible by {size}"
    return None


def choose_mode(config, size: int, requested: str = "auto") -> str:
    """The sequence-parallel attention for a model: ``"ulysses"`` or ``"all_gather"`` (``requested`` "auto": ulysses
    where the heads allow).

    Raises:
        ConfigError: ``requested`` is "ulysses" and the heads do not allow it (one line, naming the fix).
    """
    heads, kv, _, _ = head_counts(config)
    problem = ulysses_problem(heads, kv, size)
    if requested == "ulysses" and problem:
        raise ConfigError([f"--sequence_parallel_mode ulysses with --sequence_parallel_size {size}: {problem}; use "
                           "--sequence_parallel_mode all_gather (any head count) or a size that divides the heads"])
    if requested == "all_gather" or (requested == "auto" and problem):
        return "all_gather"
    return "ulysses"


def _gather_sequence(t: torch.Tensor, group) -> torch.Tensor:
    """``[B, H, L, D]`` slices of the group's ranks, concatenated along the sequence (rank order), with autograd."""
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(t.contiguous(), group=group), dim=2)


def _row_bounds(kwargs: dict, sp: SequenceParallel, local_len: int) -> list[tuple[int, int]]:
    """The documents of the whole row: from ``cu_seq_lens_q`` (the collator's, whole-row offsets) or else from the
    group's gathered position ids."""
    total = local_len * sp.size
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return bounds_from_cu_seqlens(cu, 1, total)[0]
    pos = kwargs.get("position_ids")
    if pos is None:
        raise ValueError(f"attention '{SP_ALL_GATHER}': neither cu_seq_lens_q nor position_ids reach the attention")
    import torch.distributed as dist

    parts = [torch.empty_like(pos) for _ in range(sp.size)]
    dist.all_gather(parts, pos.contiguous(), group=sp.group)
    from sft.data.batches.packing import document_bounds

    return document_bounds(torch.cat(parts, dim=1), 1)[0]


def all_gather_attention(sp: SequenceParallel):
    """The ``all_gather`` attention function for this process's group (see the module docstring).

    The function takes the ``AttentionInterface`` arguments: ``query`` ``[1, heads, L/N, head_dim]`` (this rank's
    slice of the row), ``key`` / ``value`` ``[1, kv_heads, L/N, head_dim]``; ``cu_seq_lens_q`` (int32, the whole
    row's document offsets) or ``position_ids`` in ``kwargs``. Returns ``([1, L/N, heads, head_dim], None)``.
    Raises ValueError on a batch of more than one row or a 2-D attention mask (the split collator gives neither).
    """

    def forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                **kwargs):
        from transformers.integrations.sdpa_attention import repeat_kv

        if query.shape[0] != 1 or attention_mask is not None:
            raise ValueError(f"attention '{SP_ALL_GATHER}': expects one padding-free row per micro batch without an "
                             f"attention mask, got a batch of {query.shape[0]} and mask {attention_mask is not None}")
        local = query.shape[2]
        offset = sp.rank * local
        bounds = _row_bounds(kwargs, sp, local)
        n_rep = getattr(module, "num_key_value_groups", 1)
        key = repeat_kv(_gather_sequence(key, sp.group), n_rep)
        value = repeat_kv(_gather_sequence(value, sp.group), n_rep)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        parts = []
        for s, e in bounds:
            qs, qe = max(s, offset), min(e, offset + local)
            if qs >= qe:
                continue
            q = query[:, :, qs - offset:qe - offset]
            k, v = key[:, :, s:qe], value[:, :, s:qe]
            if qs > s:  # query i (global qs + i) sees keys s .. qs + i: SDPA's causal form aligns queries and keys
                # at their first rows, so the piece is preceded by qs - s placeholder queries whose rows are dropped
                # (no [queries, keys] mask: a mask sends CPU SDPA to its math kernel, memory quadratic in the length)
                q = torch.cat([q.new_zeros(*q.shape[:2], qs - s, q.shape[3]), q], dim=2)
            out = sdpa(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True)
            parts.append(out[:, :, qs - s:] if qs > s else out)
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return out.transpose(1, 2).contiguous(), None

    return forward


def ulysses_attention(config, sp: SequenceParallel):
    """The ``ulysses`` attention function: DeepSpeed's ``UlyssesSPAttentionHF`` around
    :func:`sft.model.attention.packed_attention_forward`, for one row per micro batch of any length divisible by N
    (the split collator pads to that)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    heads, kv, dim, layers = head_counts(config)
    uattn = UlyssesSPAttentionHF(attn=packed_attention_forward, batch_size=1, attn_head_count=heads,
                                 attn_head_size=dim, kv_head_count=kv, num_hidden_layers=layers,
                                 process_group=sp.group, seq_length_is_variable=True)

    def forward(module, query, key, value, attention_mask, *args, **kwargs):
        # A mask built for the slice is meaningless for the whole row; the split collator gives none (DeepSpeed's own
        # wrapper, register_with_transformers, drops it the same way).
        return uattn(module, query, key, value, None, *args, **kwargs)

    return forward


def use_sequence_parallel_attention(model, sp: SequenceParallel, requested: str = "auto") -> str:
    """Switch ``model`` (a transformers model, or a peft model around one) that runs
    :data:`sft.model.attention.PACKED_ATTENTION` to sequence-parallel attention over ``sp``'s group. Returns the
    mode used ("ulysses" or "all_gather").

    Raises:
        ConfigError: the model does not run the per-document attention (its attention implementation, a sliding
            window or a soft cap), or Ulysses was requested and the heads do not allow it.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from sft.compat.transformers import attn_implementation

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    impl = attn_implementation(base.config)
    if impl != PACKED_ATTENTION:
        raise ConfigError([f"--sequence_parallel_size {sp.size}: the model runs attention '{impl}', not the "
                           f"per-document '{PACKED_ATTENTION}' that sequence parallelism builds on (it needs sdpa or "
                           "flash_attention_2 without a sliding window or soft cap); use --sequence_parallel_size 1"])
    mode = choose_mode(base.config, sp.size, requested)
    name, fn = ((SP_ULYSSES, ulysses_attention(base.config, sp)) if mode == "ulysses"
                else (SP_ALL_GATHER, all_gather_attention(sp)))
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, packed_mask)
    base.set_attn_implementation(name)
    heads, kv, _, _ = head_counts(base.config)
    logger.info("sequence parallelism: %d ranks per micro batch, attention '%s' (%d heads, %d KV heads)", sp.size,
                mode, heads, kv)
    return mode
