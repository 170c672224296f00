"""What a model's layers compute per token, found by what they are, not by the model's name: FLOPs per trained token
(for MFU, :mod:`sft.train.metrics`) and the parameters behind them (total, routed experts, active per token; for the
memory plan's line, :mod:`sft.train.memory_plan`).

The walk (:func:`census`) visits every module once and sorts what it holds:

* **weights** (``torch.nn.Linear``, gptqmodel's quantized linears, ``torch.nn.Conv1d``): ``in x out`` weights (a
  convolution: ``weight.numel()``, its ``out x in / groups x kernel`` multiply-adds per position), so 4-bit packed
  weights count as the matrix they stand for;
* **routed experts**: the experts modules of :func:`sft.model.experts.experts_modules` (3-D parameters ``[E, a, b]``
  held by the module itself: transformers 5's fused experts, ``@use_experts_implementation``, or 3-D parameters
  beside a router of E rows; a depthwise ``Conv1d``'s ``[C, 1, K]`` weight is a convolution, not experts). Each
  token runs ``top_k`` of the ``E`` experts, so their weights count at ``top_k / E``; so does everything under a
  wrapper whose ``base_layer`` leads to them (peft's ``ParamWrapper`` adapters, ``r x E`` wide).
  ``top_k`` is read from the router next to them (a sibling or an ancestor's attribute ``top_k``), else the config's
  ``num_experts_per_tok`` / ``num_experts_per_token`` / ``moe_topk``; none found: every expert counts (``top_k = E``).
  Parameters under bitsandbytes' ``replace_parameter_4bit`` count by their quantization state's shape;
* **routers**: a module with an int ``top_k`` holding a 2-D ``weight`` that is not a ``Linear``: ``E x hidden``;
* **token mixers that carry a state** (what a layer holding ``A_log`` computes besides its projections), forward
  FLOPs per token and layer, trained at 3x (backward: the gradients of both operands of each product, 2x forward):

  - gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) and KDA (Kimi-Linear), chunked as flash-linear-attention's
    ``chunk_gated_delta_rule`` / ``chunk_kda`` and transformers' ``torch_chunk_gated_delta_rule`` run it (chunks of
    ``C = 64``), per value head with key width ``dk``, value width ``dv``: ``C (6 dk + 4 dv) + C^2 / 3 + 6 dk dv``
    -- derived here from the kernel's stages: within a chunk ``K K^T`` (``2 C dk``), the triangular solve
    (``C^2 / 3``), ``w = T K`` and ``u = T V`` (``2 C dk + 2 C dv``), ``Q K^T`` and its product with the values
    (``2 C dk + 2 C dv``); across chunks ``W S``, ``Q S`` and the state update ``K^T U`` (``2 dk dv`` each);
  - Mamba2's state-space dual (Dao & Gu 2024, "Transformers are SSMs", sec. 6, the chunked SSD algorithm), per head
    with head width ``P``, state ``N`` and chunk ``Q`` (the layer's ``chunk_size``): ``2 Q (N + P) + 4 N P`` (the
    diagonal blocks ``C B^T`` and their product with ``X``; the chunk states ``B^T X`` and the outputs ``C h``);
  - Mamba's selective scan (Gu & Dao 2023, sec. 3.3: ``O(L D N)``), per inner channel with state ``N``: ``9 N``
    (derived: ``exp(dt A)``, ``dt B x``, the update ``h' = A_bar h + B_bar x``, the read-out ``C h``);

  each linear in the sequence length. A short causal convolution (LFM2's, the convolutions in front of those layers)
  is a ``Conv1d``: a weight, above.

FLOPs per token (:func:`model_flops_per_token`): a weight costs 2 FLOPs per token forward, 2 more backward for the
input's gradient and, when it is trained, 2 for its own (Narayanan et al. 2021, sec. 5.1; Kaplan et al. 2020,
``C = 6N``): ``4 N_frozen + 6 N_trainable`` over the weights as counted above, plus ``3 x`` the mixers' forward FLOPs.
Full attention's score and value products (``4 d T`` per token and layer at context ``T`` forward, quadratic in the
length) are not counted, as PaLM's model FLOPs leave them out (Chowdhery et al. 2022, appendix B): with documents of
``T`` tokens the figure understates the work by ``12 L_attention d T / (6 N_active)`` (about 5% for SmolLM2-135M at
200 tokens). Embedding lookups and norms are not counted; recomputation under checkpointing is not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from sft.model.experts import experts_modules, num_experts

GDN_CHUNK = 64  # flash-linear-attention's chunk (BT) for chunk_gated_delta_rule / chunk_kda; transformers' default
_TOPK_CONFIG = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "experts_per_token")


@dataclass
class Census:
    """What :func:`census` found (counts of weights, not bytes, unless named so).

    Attributes:
        weights: ``{(kind, trainable): N}`` with kind ``dense`` / ``experts`` / ``router``; ``experts`` already scaled
            by ``top_k / E`` (the weights a token runs through).
        mixer_flops: forward FLOPs per token of the state-carrying token mixers (module docstring).
        total: every parameter (logical size: 4-bit ones as the matrix they stand for).
        expert_total: the routed experts' parameters (every expert, unscaled); ``expert_active`` those a token runs.
        expert_bytes: bytes the routed experts are stored in; ``expert_dtypes`` their storage (``bfloat16``, ``nf4``).
        experts: ``(path, E, top_k)`` of each experts module.
        mixers: ``(path, kind, heads, chunk)`` of each token mixer counted (kind ``gated_delta_rule``, ``mamba2_ssd``
            or ``mamba``; ``heads`` and ``chunk`` of the chunked scans, 0 where none).
    """

    weights: dict = field(default_factory=dict)
    mixer_flops: int = 0
    total: int = 0
    expert_total: int = 0
    expert_active: int = 0
    expert_bytes: int = 0
    expert_dtypes: set = field(default_factory=set)
    experts: list = field(default_factory=list)
    mixers: list = field(default_factory=list)

    @property
    def active(self) -> int:
        """Parameters a token runs through: every parameter less the routed experts it does not run."""
        return self.total - self.expert_total + self.expert_active

    def add(self, kind: str, trainable: bool, n: float) -> None:
        self.weights[(kind, trainable)] = self.weights.get((kind, trainable), 0) + n

    def weight_count(self, trainable: Optional[bool] = None) -> int:
        return int(round(sum(n for (_, t), n in self.weights.items() if trainable is None or t == trainable)))


def _own_params(module: torch.nn.Module) -> Iterator[tuple[str, torch.Size, torch.Tensor, str]]:
    """``(name, logical shape, stored tensor, storage name)`` of the parameters ``module`` holds itself, those under a
    bitsandbytes 4-bit parametrization by their quantization state's shape (``quant_type``, e.g. ``nf4``)."""
    for name, p in module.named_parameters(recurse=False):  # DeepSpeed ZeRO-3 keeps the full shape in ds_shape
        yield name, torch.Size(getattr(p, "ds_shape", None) or p.shape), p, str(p.dtype).replace("torch.", "")
    for name, plist in getattr(module, "parametrizations", {}).items():
        original = plist.original
        state = next((getattr(q, "quant_state", None) for q in plist if getattr(q, "quant_state", None)), None)
        shape = torch.Size(state.shape) if state is not None else original.shape
        storage = getattr(state, "quant_type", None) or str(original.dtype).replace("torch.", "")
        yield name, shape, original, storage
        absmax = getattr(state, "absmax", None)  # the 4-bit blocks' scales, stored beside the packed weights
        if isinstance(absmax, torch.Tensor):
            yield f"{name}.absmax", torch.Size([0]), absmax, storage


def _top_k(chain: list, config) -> Optional[int]:
    """The router's ``top_k`` nearest above the experts (an ancestor's or its child's attribute), else the config's."""
    for ancestor in reversed(chain[-4:]):
        for m in (ancestor, *ancestor.children()):
            k = getattr(m, "top_k", None)
            if isinstance(k, int) and k > 0:
                return k
    for c in (config, getattr(config, "text_config", None)):
        for name in _TOPK_CONFIG:
            k = getattr(c, name, None)
            if isinstance(k, int) and k > 0:
                return k
    return None


def _base_experts(module: torch.nn.Module, found: dict) -> Optional[torch.nn.Module]:
    """The experts module (a key of ``found``, ids) a wrapper's ``base_layer`` chain leads to (peft's
    ``ParamWrapper``), or None."""
    seen, m = 0, getattr(module, "base_layer", None)
    while isinstance(m, torch.nn.Module) and seen < 8:
        if id(m) in found:
            return m
        m, seen = getattr(m, "base_layer", None), seen + 1
    return None


def _dim(module, *names) -> int:
    return next((v for v in (getattr(module, n, None) for n in names) if isinstance(v, int) and v > 0), 0)


def mixer_flops(module: torch.nn.Module) -> tuple[Optional[str], int, int, int]:
    """``(kind, forward FLOPs per token, heads, chunk)`` of a state-carrying token mixer that holds ``A_log`` itself
    (module docstring); ``(None, 0, 0, 0)`` for any other module. Sizes are read from the layer's attributes
    (transformers 5.24)."""
    if "A_log" not in dict(module.named_parameters(recurse=False)):
        return None, 0, 0, 0
    n = _dim(module, "ssm_state_size")
    if n:
        heads, p = _dim(module, "num_heads"), _dim(module, "head_dim")
        if heads and p:  # Mamba2: chunked SSD
            q = _dim(module, "chunk_size") or 256
            return "mamba2_ssd", heads * (2 * q * (n + p) + 4 * n * p), heads, q
        return "mamba", 9 * _dim(module, "intermediate_size") * n, 0, 0
    heads = _dim(module, "num_v_heads", "num_heads")
    dk, dv = _dim(module, "head_k_dim", "head_dim"), _dim(module, "head_v_dim", "head_dim")
    if not (heads and dk and dv):
        return None, 0, 0, 0
    c = GDN_CHUNK
    return "gated_delta_rule", int(heads * (c * (6 * dk + 4 * dv) + c * c / 3 + 6 * dk * dv)), heads, c


def census(model: torch.nn.Module) -> Census:
    """Walk ``model`` once (module docstring) and count its weights, routed experts, routers and token mixers."""
    out, config, seen, held = Census(), getattr(model, "config", None), set(), set()
    found = {id(m): num_experts(m) for _, m, _ in experts_modules(model)}  # the one rule (sft.model.experts)

    def visit(path: str, module: torch.nn.Module, chain: list, scale: float) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        trainable = lambda t: bool(getattr(t, "requires_grad", False))  # noqa: E731
        own = list(_own_params(module))
        out.total += sum(shape.numel() for _, shape, t, _ in own if id(t) not in held)  # tied weights once
        held.update(id(t) for _, _, t, _ in own)
        kind = "experts" if scale < 1 else "dense"
        if isinstance(module, torch.nn.Linear):
            out.add(kind, trainable(module.weight), scale * module.in_features * module.out_features)
        elif type(module).__module__.startswith("gptqmodel.") and hasattr(module, "qweight"):
            out.add(kind, False, scale * module.in_features * module.out_features)
        elif isinstance(module, torch.nn.Conv1d):
            out.add(kind, trainable(module.weight), scale * module.weight.numel())
        else:
            experts = found.get(id(module))
            wrapped = None if experts else _base_experts(module, found)
            if experts or wrapped is not None:
                e = experts or found[id(wrapped)]  # this rank's experts (E/N under expert parallelism)
                total = getattr(module if experts else wrapped, "sft_expert_slice", (0, e, e))[2]  # E of the model
                k = min(total, _top_k(chain, config) or total)
                scale = k / e  # a token runs k of the model's E experts: k x one expert's FLOPs, wherever they are
            if experts:
                out.experts.append((path, total, k))
                for name, shape, t, storage in own:
                    if name.endswith(".absmax"):
                        out.expert_bytes += t.numel() * t.element_size()
                    elif len(shape) in (2, 3) and shape[0] == e:  # the 3-D weights and their [E, out] biases
                        out.expert_total += shape.numel()
                        out.expert_active += shape.numel() * k // e
                        out.expert_bytes += int(getattr(t, "ds_numel", 0) or t.numel()) * t.element_size()
                        out.expert_dtypes.add(storage)
                        if len(shape) == 3:
                            out.add("experts", trainable(t), scale * shape.numel())
            k = getattr(module, "top_k", None)
            weight = dict((n, (s, t)) for n, s, t, _ in own).get("weight")
            if isinstance(k, int) and weight is not None and len(weight[0]) == 2:
                out.add("router", trainable(weight[1]), weight[0].numel())
            mix, flops, heads, chunk = mixer_flops(module)
            if mix:
                out.mixers.append((path, mix, heads, chunk))
                out.mixer_flops += flops
        for name, child in module.named_children():
            if name == "parametrizations":  # parametrize originals: counted above, by logical shape
                continue
            visit(f"{path}.{name}" if path else name, child, chain + [module], scale)

    visit("", model, [], 1.0)
    return out


def model_flops_per_token(model: torch.nn.Module) -> int:
    """Training FLOPs per token: ``4 N_frozen + 6 N_trainable`` over the weights (routed experts at ``top_k / E``)
    plus 3x the state-carrying mixers' forward FLOPs (module docstring). An int; 0 for a model with neither."""
    c = census(model)
    return 4 * c.weight_count(False) + 6 * c.weight_count(True) + 3 * c.mixer_flops


def head_flops_per_token(model: torch.nn.Module) -> int:
    """The LM head's share of :func:`model_flops_per_token` (``model.get_output_embeddings()`` and its adapter
    layers, if any); 0 for a model without one."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return model_flops_per_token(head) if isinstance(head, torch.nn.Module) else 0
