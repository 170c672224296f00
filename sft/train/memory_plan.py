"""Memory planned before step 1: the peak of a training step estimated from the loaded model and the largest micro
batch, set against the memory this process may use, with gradient checkpointing turned on when it is needed and a
refusal (exit 2) with the fixes when even that does not fit.

The planned peak (bytes) is the sum of
* ``weights``: what the process holds after loading the model: ``torch.cuda.memory_allocated`` on CUDA; on CPU the
  resident set (``VmRSS``, so it also counts the libraries and the tokenizer);
* ``gradients``: one per trainable parameter in its dtype (sharded by the world size under ZeRO-2/3 and FSDP; twice
  under DDP, whose reducer copies them into its communication buckets: ``gradient_as_bucket_view`` is off in
  accelerate's ``DistributedDataParallelKwargs``, the Trainer's; but once for experts cut by ``--expert_parallel_size
  N``, which DDP leaves alone). The model is planned as this rank holds it: under expert parallelism E/N experts per
  layer (:mod:`sft.model.expert_parallel`), so their weights, gradients and optimizer state count 1/N;
* ``optimizer``: the optimizer's state per trainable parameter (:func:`optimizer_bytes`; under DeepSpeed an
  fp32 master copy and fp32 Adam moments, sharded by the world size from ZeRO-1 on), created at the first optimizer
  step, so step 2 is the first that holds it next to activations;
* ``staged``: under ``--save_async`` on CPU, the host copy of a checkpoint being written in the background
  (:mod:`sft.train.async_save`): the weights it saves (the adapter under LoRA, else every weight) and the optimizer
  state, this rank's shards under FSDP2 (on CUDA the copy is in pinned host memory, not on the device: 0);
* ``activations``: bytes per token (below) x the tokens of the largest micro batch this rank holds (padding-free: the
  :class:`sft.train.trainer.TokenBudgetBatchSampler`'s largest; padded: micro batch x longest sample; packed: micro
  batch x longest row; under sequence parallelism of N, :class:`ParallelShape`, ``ceil(tokens / N)`` of them);
* ``head``: at supervised positions only (:mod:`sft.model.loss`), :data:`HEAD_BYTES_PER_LOGIT` per logit of one chunk
  of at most ``MAX_LOGIT_ELEMENTS`` (every token of the micro batch taken as supervised, an upper bound: the plan does
  not know the labels); at every position, the logits, their fp32 upcast and fp32 gradient.

Available (bytes): CUDA: free device memory + what this process already allocated (``torch.cuda.mem_get_info``); CPU:
the resident set + ``MemAvailable`` (``/proc/meminfo``, or what this process's memory cgroup, v1 or v2, still lets it
take when smaller: :func:`sft.train.host_memory.cgroup_room`) divided among the processes of this node, and never more
than that cgroup's limit divided among them. A plan fits when it is at most :data:`FIT` of available; the rest is left
to the allocator's caching and fragmentation. With several processes every rank plans, and the decision (checkpointing
on, refusal) is taken on the worst rank, so all ranks take the same one. A refusal names the fixes: the token budget
that fits, checkpointing, the smallest sequence-parallel size that fits (:func:`fitting_sequence_parallel`), and the
caller's (LoRA, a ZeRO stage).

Activations per token: :mod:`sft.train.activations` (the probe, the count from the model's shape and the
factors that make them a step's peak). Parameters (total, routed experts, active per token, the experts' bytes in
their storage, bf16 or NF4 under ``--q_lora``): :func:`sft.train.counting.census`, shown in the plan's line.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from sft.distributed.collectives import gather_objects, rank as global_rank
from sft.errors import SFTError
from sft.model.loss import MAX_LOGIT_ELEMENTS
from sft.train.activations import (  # noqa: F401  (re-exported: the plan's factors and probe)
    BACKWARD_FACTOR,
    BACKWARD_FACTOR_FROZEN,
    CHECKPOINTED_LAYERS,
    CHECKPOINTED_LAYERS_FROZEN,
    CHECKPOINTED_LAYERS_MMAPPED,
    HEAD_BYTES_PER_LOGIT,
    PROBE_TOKENS,
    _dim,
    activation_bytes_per_token,
    checkpointed_layers,
    chunk_buffer_bytes,
    measure_saved_bytes,
    probe_logged,
)
from sft.train.counting import census
from sft.train.host_memory import cgroup_room, page_in, trim_heap

logger = logging.getLogger("sft")

GIB = 2 ** 30
FIT = 0.9  # a plan fits when it needs at most this share of the available memory


def optimizer_bytes(optim: str, trainable_bytes: int, trainable: int) -> tuple[int, int]:
    """``(state, step)``: bytes of optimizer state for ``trainable`` parameters holding ``trainable_bytes`` bytes, and
    what its step allocates for a moment, after backward has freed the activations and the LM head, by transformers'
    ``--optim`` name. State: 8-bit optimizers 2 bytes per parameter, Adafactor and plain SGD about nothing, Adagrad,
    Lion and SGD with momentum one copy, every other one (AdamW and its variants) two copies in the parameters' dtype
    (torch's AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like the parameter). Step: one copy for those, whose
    multi-tensor step writes ``sqrt(exp_avg_sq)`` of every parameter into new tensors (``_foreach_sqrt`` in
    ``torch/optim/adamw.py``); 0 for the others."""
    name = str(getattr(optim, "value", optim)).lower()
    if "8bit" in name:
        return 2 * trainable, 0
    if "adafactor" in name or name == "sgd":
        return 0, 0
    if "adagrad" in name or "lion" in name or "rmsprop" in name:
        return trainable_bytes, 0
    return 2 * trainable_bytes, trainable_bytes


def _kib_field(path: str, key: str) -> Optional[int]:
    """``key: N kB`` from a /proc file, in bytes; None where it is missing."""
    try:
        with open(path) as f:
            return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":")), None)
    except OSError:
        return None


def resident_bytes() -> int:
    """This process's resident set now (``VmRSS``), bytes; 0 where ``/proc`` has none."""
    return _kib_field("/proc/self/status", "VmRSS") or 0


def held_and_available(device: torch.device, local_world_size: int = 1, model=None) -> tuple[int, int, str]:
    """``(held, available, what)`` in bytes: what this process holds now and the most it may hold (module docstring);
    ``what`` names the two for the log line. On CPU, ``model``'s weights are paged in and the heap's free memory given
    back first (:func:`sft.train.host_memory.page_in`, :func:`sft.train.host_memory.trim_heap`), so that the resident
    set is what the step will hold."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        held = int(torch.cuda.memory_allocated(device))
        return held, int(free) + held, f"{device} memory (allocated + free)"
    if model is not None:
        page_in(model)
    trim_heap()
    held = resident_bytes()
    room = cgroup_room()
    free = [v for v in (_kib_field("/proc/meminfo", "MemAvailable"), room and room[0]) if v is not None]
    if not free:
        return held, 0, "host memory (unknown)"
    n = max(1, local_world_size)
    share = f" / {n} processes on this node" if n > 1 else ""
    available = held + min(free) // n
    if room is not None and room[1] // n < available:  # the cgroup's limit bounds it too (host_memory.cgroup_room)
        return held, room[1] // n, f"memory cgroup limit{share}"
    return held, available, f"host memory (resident + available{share})"


@dataclass
class MemoryPlan:
    """One process's planned peak (bytes) of a training step; see the module docstring for each part."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    head: int
    tokens: int
    per_token: int
    checkpointing: bool
    available: int
    where: str
    sequence_parallel: int = 1
    world_size: int = 1
    head_per_token: int = 0  # the LM head's bytes per token of this rank, up to head_max (0: the head as it is)
    head_max: Optional[int] = None
    optimizer_step: int = 0  # what the optimizer step allocates for a moment, once activations and head are freed
    staged: int = 0  # the host copy of a checkpoint written in the background (--save_async on CPU)
    parameters: Optional[dict] = None  # params_line's figures: total, experts, active, expert_bytes, expert_dtypes

    def head_for(self, rank_tokens: int) -> int:
        """The LM head's bytes for ``rank_tokens`` tokens on this rank."""
        if self.head_per_token <= 0:
            return self.head
        head = self.head_per_token * int(rank_tokens)
        return head if self.head_max is None else min(head, self.head_max)

    @property
    def rank_tokens(self) -> int:
        """The tokens of the largest micro batch this rank holds: ``ceil(tokens / sequence_parallel)``."""
        return -(-self.tokens // max(1, self.sequence_parallel))

    @property
    def fixed(self) -> int:
        """What does not depend on the micro batch: weights + gradients + optimizer state (+ a staged checkpoint)."""
        return self.weights + self.gradients + self.optimizer + self.staged

    @property
    def peak(self) -> int:
        return self.fixed + max(self.activations + self.head, self.optimizer_step)

    @property
    def fits(self) -> bool:
        return self.available <= 0 or self.peak <= FIT * self.available

    def line(self) -> str:
        g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
        split = (f" / {self.sequence_parallel} sequence-parallel ranks = {self.rank_tokens} per rank"
                 if self.sequence_parallel > 1 else "")
        return (f"memory plan: weights {g(self.weights)} + gradients {g(self.gradients)} + optimizer "
                f"{g(self.optimizer)}{f' + staged checkpoint {g(self.staged)}' if self.staged else ''} + activations "
                f"{g(self.activations)} ({self.tokens} tokens in the largest micro "
                f"batch{split} x {self.per_token / 2 ** 10:.0f} KiB, gradient checkpointing "
                f"{'on' if self.checkpointing else 'off'}) + LM head {g(self.head)} = {g(self.peak)} GiB planned peak "
                f"of {g(self.available)} GiB {self.where}{params_line(self.parameters)}")


def params_line(p: Optional[dict]) -> str:
    """``; parameters T (E in routed experts, B GiB in D; A active per token)`` of :func:`parameter_figures`' dict;
    ``""`` without one. Counts in millions (``M``) when at least 10**6, else as they are."""
    if not p:
        return ""
    n = lambda v: f"{v / 1e6:.1f}M" if v >= 1e6 else f"{v}"  # noqa: E731
    experts = (f" ({n(p['experts'])} in routed experts, {p['expert_bytes'] / GIB:.2f} GiB in "
               f"{'/'.join(p['expert_dtypes'])}; {n(p['active'])} active per token)" if p["experts"] else "")
    return f"; parameters {n(p['total'])}{experts}"


def parameter_figures(model, counted=None) -> dict:
    """``{"total", "experts", "active", "expert_bytes", "expert_dtypes"}`` of ``model`` (:func:`sft.train.counting.
    census`): parameters by their logical size (4-bit ones as the matrix they stand for, ZeRO-3's by ``ds_shape``),
    those of routed experts, those a token runs (experts at ``top_k / E``), the bytes the experts are stored in and
    their storage names (``bfloat16``; ``nf4`` under ``--q_lora``)."""
    c = counted or census(model)
    return {"total": c.total, "experts": c.expert_total, "active": c.active, "expert_bytes": c.expert_bytes,
            "expert_dtypes": sorted(c.expert_dtypes)}



@dataclasses.dataclass(frozen=True)
class ParallelShape:
    """How the job spreads a step's memory over its processes, as the memory plan counts it.

    Attributes:
        world_size: processes of the job (default 1).
        local_world_size: processes on this node, which share its host memory (default 1).
        zero_stage: DeepSpeed's ZeRO stage (0: no DeepSpeed, the default).
        deepspeed: DeepSpeed trains the model (fp32 master weights and moments; default False).
        fsdp: FSDP2 shards parameters, gradients and optimizer state (default False).
        sequence_parallel: N consecutive ranks share one micro batch's tokens (``--sequence_parallel_size``; must
            divide ``world_size``; default 1: off): each holds the activations of ``ceil(tokens / N)`` of them;
            weights, gradients and optimizer state are counted as without it (sharded, where they are, over the whole
            world).
    """

    world_size: int = 1
    local_world_size: int = 1
    zero_stage: int = 0
    deepspeed: bool = False
    fsdp: bool = False
    sequence_parallel: int = 1


def plan(model, *, tokens: int, checkpointing: bool, optim: str, parallel: ParallelShape = ParallelShape(),
         supervised_head: bool = True, lora_dropout: bool = False, device: Optional[torch.device] = None,
         held_available: Optional[tuple[int, int, str]] = None,
         measured: Optional[tuple[float, float]] = None, staged_checkpoint: bool = False) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``model`` (loaded, adapters applied) for a largest micro batch of ``tokens``,
    spread over the processes as ``parallel`` says (:class:`ParallelShape`; under sequence parallelism of N this rank's
    activations and LM head are those of ``ceil(tokens / N)`` tokens).

    ``held_available``: ``(held, available, what)`` as :func:`held_and_available` returns it (measured when None).
    ``measured``: :func:`measure_saved_bytes`'s result; the activations per token are then that total (checkpointing
    off) or every layer's input plus two layers (on); without it, :func:`activation_bytes_per_token` from the model's
    shape; either times the backward factor (module docstring). ``staged_checkpoint``: checkpoints are written in
    the background (``--save_async``): on CPU their host copy is counted (``staged``, module docstring).
    """
    device = torch.device(device or "cpu")
    held, available, where = held_available or held_and_available(device, parallel.local_world_size)
    zero_stage, deepspeed, fsdp = parallel.zero_stage, parallel.deepspeed, parallel.fsdp
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    numel = lambda p: int(getattr(p, "ds_numel", 0) or p.numel())  # noqa: E731  (ZeRO-3: the full size)
    n_trainable = sum(numel(p) for p in trainable)
    trainable_bytes = sum(numel(p) * p.element_size() for p in trainable)
    w = max(1, int(parallel.world_size))
    sp = max(1, int(parallel.sequence_parallel))
    rank_tokens = math.ceil(int(tokens) / sp)  # this rank's share of the micro batch's tokens
    gradients = trainable_bytes // w if (fsdp or zero_stage >= 2) else trainable_bytes
    if w > 1 and not deepspeed and not fsdp:  # DDP's reducer holds them again in its buckets (module docstring)
        cut = {id(p) for p, _, _ in getattr(model, "sft_expert_shards", None) or ()}  # E/N experts here, not DDP's
        gradients += trainable_bytes - sum(numel(p) * p.element_size() for p in trainable if id(p) in cut)
    if deepspeed:  # fp32 master weights and fp32 moments (ZeRO's mixed precision), partitioned from stage 1
        optimizer = 4 * n_trainable + optimizer_bytes(optim, 4 * n_trainable, n_trainable)[0]
        optimizer = optimizer // w if zero_stage >= 1 else optimizer
        optimizer_step = 0
    else:
        optimizer, optimizer_step = optimizer_bytes(optim, trainable_bytes, n_trainable)
        optimizer, optimizer_step = (optimizer // w, optimizer_step // w) if fsdp else (optimizer, optimizer_step)
    staged = 0
    if staged_checkpoint and device.type == "cpu":
        saved = trainable_bytes if sum(numel(p) for p in params) > 2 * n_trainable else \
            sum(numel(p) * p.element_size() for p in params)
        staged = (saved // w if fsdp else saved) + optimizer  # under FSDP the optimizer state is this rank's already
    weights = held
    if fsdp and w > 1:  # loaded whole, sharded when training starts
        weights = held - sum(numel(p) * p.element_size() for p in params) * (w - 1) // w
    floating = [p for p in params if p.is_floating_point()]
    base = [p for p in floating if not p.requires_grad] or floating
    act_bytes = max((p.element_size() for p in base), default=4)
    if act_bytes >= 4 and any(p.dtype in (torch.bfloat16, torch.float16) for p in floating):
        act_bytes = 2
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    lora_bytes = lora[0].element_size() if lora else 0
    config = getattr(model, "config", None)
    h = _dim(config, "hidden_size", "n_embd", default=1)
    layers = _dim(config, "num_hidden_layers", "n_layer", default=1)
    if measured is not None:
        saved_off, layer = measured
    else:
        saved_off = activation_bytes_per_token(config, act_bytes, False, lora_bytes, lora_dropout and bool(lora))
        layer = saved_off / layers
    frozen_base = sum(numel(p) for p in params) > 2 * n_trainable  # adapters, not the weights, are trained
    key = 2 if act_bytes <= 2 else 4
    per_token = int(saved_off * (BACKWARD_FACTOR_FROZEN[key] if frozen_base else BACKWARD_FACTOR))
    recomputed = 0  # bytes of the recomputed layers when glibc unmaps their blocks (sft.train.activations)
    if checkpointing:  # every layer's input, and what one layer's recomputation and backward take (module docstring)
        kept = checkpointed_layers((CHECKPOINTED_LAYERS_FROZEN if frozen_base else CHECKPOINTED_LAYERS)[key],
                                   rank_tokens, h, act_bytes, device.type)
        per_token = min(per_token, int(layers * act_bytes * h + kept * layer))
        recomputed = int(kept * layer * rank_tokens) if kept == CHECKPOINTED_LAYERS_MMAPPED else 0
    vocab = _dim(config, "vocab_size", default=0)
    # sft.model.loss: chunks of at most MAX_LOGIT_ELEMENTS logits (every token taken as supervised: an upper bound)
    if supervised_head:
        head_per_token, head_max = int(HEAD_BYTES_PER_LOGIT * vocab), int(HEAD_BYTES_PER_LOGIT * MAX_LOGIT_ELEMENTS)
    else:  # every position: logits, their fp32 upcast and the fp32 gradient of the log-softmax
        head_per_token, head_max = vocab * (act_bytes + 4 + 4), None
    head = head_per_token * rank_tokens if head_max is None else min(head_per_token * rank_tokens, head_max)
    # the LM head's backward ends before the first recomputed layer's starts: with blocks unmapped when freed the step
    # holds the larger of the two, not their sum (fp32 LoRA at 17,901 tokens, 8 layers: inputs + 2 layers)
    head = max(0, head - recomputed)
    counted = census(model)
    activations = per_token * rank_tokens + chunk_buffer_bytes(counted.mixers, rank_tokens, checkpointing)
    return MemoryPlan(weights=int(weights), gradients=int(gradients), optimizer=int(optimizer),
                      activations=int(activations), head=int(head), tokens=int(tokens),
                      per_token=int(per_token), checkpointing=checkpointing, available=int(available), where=where,
                      sequence_parallel=sp, world_size=w, head_per_token=int(head_per_token), head_max=head_max,
                      optimizer_step=int(optimizer_step), staged=int(staged),
                      parameters=parameter_figures(model, counted))


def _worst(plans: list[MemoryPlan]) -> tuple[int, MemoryPlan]:
    """The rank whose plan leaves the least room (its index and plan)."""
    return min(enumerate(plans),
               key=lambda rp: (rp[1].available * FIT - rp[1].peak) if rp[1].available > 0 else float("inf"))


def fitting_tokens(p: MemoryPlan) -> int:
    """The most tokens a micro batch may hold for ``p`` to fit (0 when nothing fits): the most one rank's activations
    may hold, times ``p.sequence_parallel``. The LM head's part is taken as it is (at supervised positions it is one
    chunk whatever the tokens, else it only shrinks with them)."""
    room = FIT * p.available - p.fixed - p.head
    if p.per_token <= 0 or p.fixed + p.optimizer_step > FIT * p.available:
        return 0
    return max(0, int(room // p.per_token)) * p.sequence_parallel


def fitting_sequence_parallel(p: MemoryPlan) -> Optional[int]:
    """The smallest sequence-parallel size N (a power of two above ``p.sequence_parallel``, at most the world size and
    dividing it) at which ``p``'s micro batch fits, each rank holding the activations of ``ceil(tokens / N)`` tokens;
    None where none does (or one process). Weights, gradients and optimizer state are taken as they are."""
    if p.per_token <= 0:
        return None
    n = 2
    while n <= p.world_size:
        rank_tokens = math.ceil(p.tokens / n)
        if (n > p.sequence_parallel and p.world_size % n == 0 and p.fixed + max(
                p.head_for(rank_tokens) + p.per_token * rank_tokens, p.optimizer_step) <= FIT * p.available):
            return n
        n *= 2
    return None


def choose_checkpointing(make_plan, requested: Optional[bool], mode: str = "refuse",
                         fixes_extra: tuple[str, ...] = (), budget_floor: Optional[int] = None
                         ) -> tuple[bool, MemoryPlan, Optional[int]]:
    """Gradient checkpointing on or off, this rank's plan, a token budget where the unset one does not fit; or refusal.

    Args:
        make_plan: ``(checkpointing, tokens=None) -> MemoryPlan`` of this rank (None: the largest micro batch's).
        requested: ``--gradient_checkpointing`` as given, or None (unset: on only when the plan without it does not
            fit on every rank).
        mode: ``--memory_check``: ``refuse`` (raise), ``warn`` (log and go on) or ``off`` (log the plan only).
        fixes_extra: further fixes to name in the refusal (e.g. a ZeRO stage).
        budget_floor: ``--model_max_length`` when ``--max_tokens_per_micro_batch`` is unset (padding-free): a plan
            that does not fit gets the largest budget that fits on every rank, if at least this, before checkpointing.
    Returns:
        ``(checkpointing, plan of this rank, token budget or None)``: a budget to form the micro batches again under.
    Raises:
        SFTError: ``mode == "refuse"`` and the chosen plan does not fit on some rank (exit 2); the message names the
            rank, the parts of its plan and the fixes.
    """
    on = bool(requested) if requested is not None else False
    plans, budget = gather_objects(make_plan(on)), None
    while not all(p.fits for p in plans):  # unset: a smaller budget first (no recomputation), then checkpointing
        tokens = min(fitting_tokens(p) for p in plans)
        if budget_floor is not None and tokens >= budget_floor:
            budget = tokens
            logger.info("token budget %d per micro batch (unset --max_tokens_per_micro_batch: the largest micro batch, "
                        "%d tokens, does not fit%s)", tokens, plans[0].tokens,
                        " with gradient checkpointing" if on else "")
            plans = gather_objects(make_plan(on, tokens))
            break
        if requested is None and not on:
            on = True
            logger.info("gradient checkpointing on (unset --gradient_checkpointing: the plan without it does not fit)")
            plans = gather_objects(make_plan(True))
        else:
            break
    rank = global_rank()
    mine = plans[rank if rank < len(plans) else 0]
    logger.info("%s", mine.line())
    worst_rank, worst = _worst(plans)
    if worst.fits or mode == "off":
        return on, mine, budget
    tokens = fitting_tokens(worst)
    fixes = []
    if tokens > 0:
        fixes.append(f"--max_tokens_per_micro_batch {tokens} (at most that many tokens per micro batch; padded or "
                     f"packed rows: a smaller --per_device_train_batch_size or --model_max_length)")
    if not on:
        fixes.append("--gradient_checkpointing True")
    sp = fitting_sequence_parallel(worst)
    if sp is not None:
        fixes.append(f"--sequence_parallel_size {sp} (the micro batch's {worst.tokens} tokens split over {sp} ranks: "
                     f"{math.ceil(worst.tokens / sp)} per rank)")
    fixes.extend(fixes_extra)
    who = f" on rank {worst_rank}" if len(plans) > 1 else ""
    message = (f"this run does not fit in memory{who}, refused before step 1: {worst.line()}, more than {FIT:.0%} of "
               f"it. Fix: " + "; or ".join(fixes or ["a device with more memory"]) +
               ". (--memory_check warn trains anyway)")
    if mode == "warn":
        logger.warning("%s", message)
        return on, mine, None
    raise SFTError(message)
