"""Layers that carry a state or a window across positions, run once per document on packed rows.

Attention keeps the documents of a padding-free or packed row apart (:mod:`sft.model.attention`); the other layers
that mix tokens carry something from one position to the next, and transformers 5.24's PyTorch paths give them no
boundaries: the gated delta rule (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid), Kimi Delta Attention, Mamba and
Mamba2 mixers (Jamba, Bamba, Nemotron-H, Falcon-H1, Granite-4.0 hybrid, Zamba/Zamba2), RG-LRU (RecurrentGemma) and
the short convolutions of LFM2. Every one of them in transformers 5.24 has a **depthwise causal ``nn.Conv1d``**
(``groups == in_channels == out_channels``, kernel > 1, left padding ``kernel - 1`` or none): that is how such a
layer is found here, by what it holds, not by its name (:func:`find_token_mixers`). The token mixer is the child of a
decoder layer (an element of an ``nn.ModuleList`` owned, beside the token embedding, by ``model.get_decoder()``)
that holds such a convolution. Recurrences without such a convolution (RWKV, xLSTM) are not found.

:func:`keep_documents_apart` replaces each token mixer's ``forward`` (on the instance: parameter names, LoRA
wrapping and gradient-checkpointing recompute are untouched) by one that, on a row holding several documents, runs
the original forward on the documents cut apart: each document a ``[1, doc_len, hidden]`` slice of the hidden states
with a fresh state (position-sized tensor arguments sliced alike, the boundary arguments ``cu_seq_lens_q/k``,
``max_length_q/k``, ``seq_idx``, ``cu_seqlens`` dropped), documents of similar lengths right-padded with zeros into one
``[documents, longest, hidden]`` batch (:func:`plan_groups`: at most :data:`PAD_WASTE` times their real positions),
the outputs cut back to each document's length and put back in place. Exact by construction: each document goes
through the very computation it would alone (every such layer is causal, so the zeros after a document's end never
reach its positions, and their outputs, dropped, send no gradient back). The cost is that of a padded batch on those
documents: one call per group, the group's longest document of sequential steps for a recurrence that steps position
by position. On CUDA too: transformers 5.24 passes ``cu_seq_lens_q`` to flash-linear-attention's gated delta rule,
but its causal convolution (``causal_conv1d_fn``, torch or the ``causal-conv1d`` package) gets neither ``cu_seqlens``
nor ``seq_idx`` from Qwen3.5's layer, so its kernel path would still leak at the convolution; this path is the one
used everywhere.

The boundaries are read once per forward, by a pre-hook on the decoder (the owner of the layer stack): the
collator's ``cu_seq_lens_q`` when given, else where ``position_ids`` restart; with an ``attention_mask`` (a padded
batch: transformers masks the padding itself) or one document per row, layers run unchanged; on a row of several
documents a cache argument is dropped (each document starts without a state).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from sft.data.batches.packing import cu_seqlens_bounds, document_bounds

logger = logging.getLogger(__name__)

BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")
CACHE_KWARGS = ("cache", "cache_params", "past_key_values", "past_key_value")
_MARK = "_sft_per_document"


def is_depthwise_causal_conv(module: torch.nn.Module) -> bool:
    """True for an ``nn.Conv1d`` with one filter per channel (``groups == in_channels == out_channels``), a kernel
    longer than 1 and causal padding (``kernel - 1`` on both sides, cut on the right, or none: padded by hand)."""
    if not isinstance(module, torch.nn.Conv1d) or module.kernel_size[0] <= 1:
        return False
    pad = module.padding if isinstance(module.padding, str) else module.padding[0]
    return (module.groups == module.in_channels == module.out_channels
            and pad in (0, module.kernel_size[0] - 1))


def _decoder(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder() if hasattr(base, "get_decoder") else base


def find_token_mixers(model) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """The layers of ``model`` (a transformers model, or a peft model around one) that carry a state or window across
    positions: ``[(qualified name, mixer module, owner of its layer stack), ...]``, in model order; empty for a model
    whose decoder layers hold no depthwise causal convolution."""
    decoder = _decoder(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    found, seen = [], set()
    for owner in decoder.modules():
        # the text decoder's stack: its owner holds the token embedding (not an audio or vision encoder's stack)
        if embed is not None and not any(c is embed for c in owner.children()):
            continue
        for stack_name, stack in owner.named_children():
            if not isinstance(stack, torch.nn.ModuleList):
                continue
            for i, layer in enumerate(stack):
                for child_name, child in layer.named_children():
                    if id(child) not in seen and any(is_depthwise_causal_conv(m) for m in child.modules()):
                        seen.add(id(child))
                        found.append((f"{stack_name}.{i}.{child_name}", child, owner))
    return found


def mixer_kinds(model) -> list[str]:
    """The class names of ``model``'s token mixers (:func:`find_token_mixers`), each once, in model order."""
    return list(dict.fromkeys(type(m).__name__ for _, m, _ in find_token_mixers(model)))


def current_documents(module, batch: int, row_len: int):
    """The documents (``[[(start, end), ...] per row]``) of the micro batch in flight in the decoder that holds
    ``module``, as its hook of :func:`keep_documents_apart` read them, when its rows are ``batch`` x ``row_len``; else
    None. For attention layers that their decoder layer hands neither ``position_ids`` nor ``cu_seq_lens_q``
    (Granite-4.0 hybrid, Zamba)."""
    holder = getattr(module, "_sft_document_bounds", None)
    rows = holder.all_rows if holder is not None else None
    return rows if rows is not None and holder.row_len == row_len and len(rows) == batch else None


class _Bounds:
    """The documents of the micro batch in flight, shared by the mixers of one decoder: ``rows`` is
    ``[[(start, end), ...] per row]`` (end exclusive) or None (run layers unchanged); ``row_len`` tokens."""

    def __init__(self):
        self.rows, self.row_len = None, 0
        self.all_rows = None  # the same, also when every row is one document (for attention: current_documents)
        self.inside = False  # a mixer's per-document call is running: a mixer nested in it runs as called

    def read(self, args, kwargs) -> None:
        """A forward pre-hook of the decoder (``with_kwargs=True``): one host copy of the boundaries per forward."""
        self.rows = self.all_rows = None
        ref = kwargs.get("inputs_embeds")
        if ref is None:
            ref = kwargs.get("input_ids", args[0] if args else None)
        if ref is None or ref.dim() < 2 or kwargs.get("attention_mask") is not None:
            return
        batch, row_len = ref.shape[0], ref.shape[1]
        cu, pos = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
        if cu is not None:
            try:
                rows = cu_seqlens_bounds([int(x) for x in cu.tolist()], batch, row_len)
            except ValueError as e:
                raise ValueError(f"per-document layers: {e}") from None
        elif pos is not None:
            pos = pos[0] if pos.dim() == 3 else pos  # multimodal rope: [sections, batch, len], the same per section
            rows = document_bounds(pos, batch)
        else:  # neither: each row is one sequence
            rows = [[(0, row_len)] for _ in range(batch)]
        self.all_rows, self.row_len = rows, row_len
        if any(len(docs) > 1 for docs in rows):
            self.rows = rows


def _slice(value, r: int, s: int, e: int, batch: int, row_len: int):
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == row_len \
            and value.shape[0] in (batch, 1):
        i = r if value.shape[0] == batch else 0
        return value[i:i + 1, s:e]
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(_slice(v, r, s, e, batch, row_len) for v in value)  # (cos, sin) position embeddings
    return value


def _join(parts: list, dim: int):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return first if len(parts) == 1 else torch.cat(parts, dim=dim)
    if isinstance(first, tuple):
        return tuple(_join([p[i] for p in parts], dim) if isinstance(first[i], torch.Tensor) else first[i]
                     for i in range(len(first)))
    return first


PAD_WASTE = 1.5  # a group of documents is padded to at most 1.5x its real tokens (plan_groups)


def plan_groups(lengths: list[int], waste: float = PAD_WASTE) -> list[list[int]]:
    """Documents of lengths ``lengths`` (tokens, each >= 1) grouped into right-padded batches: ``[[document index,
    ...] per group]``, longest documents first. Greedy over the documents sorted by length (longest first): a document
    joins the open group while ``(members + 1) * longest <= waste * (its real tokens + the document's)``, else it
    opens the next group; so a group's padded positions are at most ``waste`` times its real ones, and documents of
    similar lengths share one call (one call per document in the worst case, one call for the micro batch when the
    lengths are close, as in a padded batch)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= waste * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def _pad_stack(value, pieces: list[tuple[int, int, int]], longest: int, batch: int, row_len: int):
    """The ``(row, start, end)`` slices of ``value`` (a position-sized tensor, or a tuple of them) padded on the right
    to ``longest`` positions (zeros) and stacked into ``[len(pieces), longest, ...]``; any other value as it is."""
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(_pad_stack(v, pieces, longest, batch, row_len) for v in value)  # (cos, sin)
    if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == row_len
            and value.shape[0] in (batch, 1)):
        return value
    parts = []
    for r, s, e in pieces:
        part = _slice(value, r, s, e, batch, row_len)
        if e - s < longest:
            part = torch.cat([part, part.new_zeros((1, longest - (e - s)) + tuple(part.shape[2:]))], dim=1)
        parts.append(part)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _unpad(value, i: int, length: int, members: int, longest: int):
    """Document ``i``'s ``[1, length, ...]`` part of a group's output (tensors ``[members, longest, ...]``)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (members, longest):
        return value[i:i + 1, :length]
    if isinstance(value, tuple):
        return tuple(_unpad(v, i, length, members, longest) for v in value)
    return value


def _per_document(forward, bounds: _Bounds, kind: str):
    def run(*args, **kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        rows, row_len = bounds.rows, bounds.row_len
        if rows is None or bounds.inside:
            return forward(*args, **kwargs)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[:2] != (len(rows), row_len):
            raise ValueError(f"per-document layers: {kind} got hidden states of shape "
                             f"{tuple(getattr(hidden, 'shape', ()))}, not [{len(rows)}, {row_len}, hidden]: its "
                             "documents cannot be cut apart; train with --padding_free False (padded micro batches)")
        batch = hidden.shape[0]
        # a cache's state would be one document's, carried into the next: each document starts without one
        kept = {k: (None if k in CACHE_KWARGS else v) for k, v in kwargs.items() if k not in BOUNDARY_KWARGS}
        docs = [(r, s, e) for r, row in enumerate(rows) for s, e in row]
        outs: list = [None] * len(docs)
        bounds.inside = True
        try:
            for group in plan_groups([e - s for _, s, e in docs]):
                pieces = [docs[i] for i in group]
                longest = pieces[0][2] - pieces[0][1]
                out = forward(*[_pad_stack(a, pieces, longest, batch, row_len) for a in args],
                              **{k: _pad_stack(v, pieces, longest, batch, row_len) for k, v in kept.items()})
                for j, i in enumerate(group):
                    outs[i] = _unpad(out, j, docs[i][2] - docs[i][1], len(group), longest)
        finally:
            bounds.inside = False
        per_row, k = [], 0
        for row in rows:
            per_row.append(_join(outs[k:k + len(row)], 1))
            k += len(row)
        return _join(per_row, 0)

    run.__wrapped__ = forward
    return run


def keep_documents_apart(model) -> list[str]:
    """Make every token mixer of ``model`` (:func:`find_token_mixers`) run once per document of a packed or
    padding-free row (documents of similar lengths batched, :func:`plan_groups`; idempotent; works under LoRA and
    gradient checkpointing). Returns the mixers' class names
    (:func:`mixer_kinds`), empty when the model has none (nothing is changed then).

    Raises (during a forward):
        ValueError: ``cu_seq_lens_q`` does not cut the rows into whole documents, or a mixer gets hidden states that
            are not ``[rows, row_len, hidden]`` on a row of several documents (never a silent leak).
    """
    mixers = find_token_mixers(model)
    if mixers:  # a cache of conv and recurrent states is of no use in training (a multimodal model's text config too)
        config = _decoder(model).config
        for c in {id(c): c for c in (config, getattr(config, "text_config", None)) if c is not None}.values():
            c.use_cache = False
    holders: dict[int, _Bounds] = {}
    for _, mixer, owner in mixers:
        if getattr(mixer, _MARK, False):
            continue
        if id(owner) not in holders:
            holder = getattr(owner, "_sft_document_bounds", None)
            if holder is None:
                holder = _Bounds()
                owner.register_forward_pre_hook(lambda mod, a, kw, h=holder: h.read(a, kw), with_kwargs=True)
                for m in owner.modules():  # the attention layers of this decoder find the boundaries here too
                    m._sft_document_bounds = holder
            holders[id(owner)] = holder
        mixer.forward = _per_document(mixer.forward, holders[id(owner)], type(mixer).__name__)
        setattr(mixer, _MARK, True)
    kinds = list(dict.fromkeys(type(m).__name__ for _, m, _ in mixers))
    if kinds:
        logger.info("packed rows: %d layer(s) carrying a state or window across positions (%s) run once per document "
                    "with a fresh state (exact; cost: documents of similar lengths batched with right padding, at most "
                    "%.1fx their tokens, one call per such batch in each such layer)",
                    len(mixers), ", ".join(kinds), PAD_WASTE)
    return kinds


def meta_model(config):
    """``transformers.AutoModelForCausalLM.from_config(config)`` on the meta device (no memory, no weights): the
    model's module tree for structural questions. Raises what transformers raises for a config it cannot build."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def kinds_in_folder(model_dir: str) -> list[str]:
    """The token-mixer kinds (:func:`mixer_kinds`) of the model whose ``config.json`` is in ``model_dir``, from its
    module tree built on the meta device; empty when the config cannot be read or built (the loader reports that)."""
    from transformers import AutoConfig

    try:
        return mixer_kinds(meta_model(AutoConfig.from_pretrained(model_dir)))
    except Exception:  # noqa: BLE001 - any failure here is reported by the loader, with its own fix
        return []


def sequence_parallel_problem(size: int, model_dir: Optional[str] = None, kinds: Optional[list] = None) -> list[str]:
    """One problem line when sequence parallelism (``size`` > 1) meets a model with layers that carry a state across
    positions: a rank's slice of a row would start from a zero state instead of the previous rank's (passing the state
    from rank to rank is not implemented). The layers are ``kinds`` (:func:`mixer_kinds` of a loaded model) or read
    from the folder ``model_dir`` (its config built on the meta device, only when ``size`` > 1). Empty otherwise."""
    if kinds is None:
        kinds = kinds_in_folder(model_dir) if size > 1 and model_dir else []
    if size <= 1 or not kinds:
        return []
    return [f"--sequence_parallel_size {size}: the model has layers that carry a state across positions "
            f"({', '.join(kinds)}); a rank's part of a row would start without the state of the part before it. Use "
            "--sequence_parallel_size 1 (for longer rows: --gradient_checkpointing True, a smaller "
            "--per_device_train_batch_size)"]
