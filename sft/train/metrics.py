"""Live throughput numbers and the loss curve.

:class:`ThroughputCallback` counts the tokens each training forward pass actually computes (a forward
pre-hook on the model, so it sees exactly the batches of every micro step, packed or padded) and, at
each logging step, adds to the Trainer's log line (console, ``trainer_state.json`` and every
``--report_to`` reporter, e.g. TensorBoard under ``train/``):

* ``real_tokens_per_s`` -- non-pad tokens per second on this device (global rank 0's own count; with
  DDP every rank computes a similar share), over the wall time since the previous log line;
* ``padding_ratio`` -- pad tokens / all tokens in the window's batches (0 with ``--packing``);
* ``mfu`` -- model FLOP utilization: :func:`model_flops_per_token` x real tokens/s / peak FLOP/s of the
  device (``--peak_tflops``, else ``SFT_PEAK_TFLOPS`` from the environment, else measured once with
  :func:`measure_matmul_peak` in the training dtype); with the LM head only at supervised positions
  (:mod:`sft.model.loss`) the head's FLOPs count per supervised target instead of per token;
* ``peak_mem_gib`` -- peak resident set size of the process on CPU, ``torch.cuda.max_memory_allocated``
  on CUDA (GiB = 2**30 bytes), since training started: the peak of loading is logged apart at train start
  (``memory: ... after loading``) and both again at the end;
* ``eta_s`` -- seconds left: remaining optimizer steps x the window's seconds per step.

At the end of training it writes ``loss_curve.png`` (training loss, and evaluation loss if any, per
optimizer step) into ``--output_dir`` on global rank 0.

FLOP convention (:func:`model_flops_per_token`, :mod:`sft.train.counting`): a weight costs 2 FLOPs per token forward,
2 backward for its input's gradient and, when trained, 2 for its own: ``4 N_frozen + 6 N_trainable`` per token over
the linear (and convolution) weights, routed experts at ``top_k / E`` of theirs with the routers, plus 3x the forward
FLOPs of the layers that carry a state (gated delta rule, KDA, Mamba/Mamba2: each by its own formula, linear in the
length). Full attention's score/value products (quadratic in the length), embedding lookups and norms are not
counted, nor recomputation under checkpointing (model FLOPs, not hardware FLOPs: Chowdhery et al. 2022, PaLM,
appendix B).
"""
from __future__ import annotations

import logging
import math
import os
import resource
import time
from typing import Optional

import torch
from transformers import TrainerCallback

from sft.train.counting import census, head_flops_per_token, model_flops_per_token  # noqa: F401  (re-exported)
from sft.train.host_memory import trim_heap

logger = logging.getLogger("sft")

GIB = 2 ** 30


def linear_weight_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(frozen, trainable)`` numbers of weights in ``torch.nn.Linear`` layers (and subclasses).

    Uses ``in_features * out_features`` rather than ``weight.numel()`` so that 4-bit packed weights
    (bitsandbytes ``Linear4bit``) count as the matrix they stand for; gptqmodel's quantized linears (GPTQ
    bases; not ``torch.nn.Linear``, integer buffers, always frozen) count the same way.
    """
    frozen = trainable = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            n = m.in_features * m.out_features
            if m.weight.requires_grad:
                trainable += n
            else:
                frozen += n
        elif type(m).__module__.startswith("gptqmodel.") and hasattr(m, "qweight"):
            frozen += m.in_features * m.out_features
    return frozen, trainable


def measure_matmul_peak(dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None,
                        n: Optional[int] = None, seconds: float = 0.5) -> float:
    """Best achieved FLOP/s of a square ``torch.matmul`` on ``device`` in ``dtype`` (2 n^3 FLOPs per product).

    The best of repeated timed products over about ``seconds`` seconds after a warm-up. Without ``n`` the size
    doubles from 256 while one product takes under a quarter of ``seconds`` (up to 2048 on CPU, 8192 on CUDA), so
    a dtype the CPU emulates slowly (bf16 without native kernels) does not take minutes. A measured peak, not
    the datasheet figure.

    The operands come from a generator of its own, never from the global RNG: the size the timing picks varies
    with the machine's load, and drawing from the global RNG on rank 0 (in ``on_train_begin``, after the
    Trainer's seeding) gave that rank other dropout masks in every run whose load made it stop doubling at
    another size, so two runs with the same seed trained differently (LoRA kill-and-resume, docs/fsdp.md).
    """
    device = torch.device(device or "cpu")
    generator = torch.Generator(device=device).manual_seed(0)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def once(a, b) -> float:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync()
        return time.perf_counter() - t0

    def operands(size):
        return tuple(torch.randn(size, size, device=device, generator=generator).to(dtype) for _ in range(2))

    if n is None:
        n, limit = 256, (8192 if device.type == "cuda" else 2048)
        a, b = operands(n)
        once(a, b)
        while n < limit and once(a, b) < seconds / 4:
            n *= 2
            a, b = operands(n)
            once(a, b)
    else:
        a, b = operands(n)
        once(a, b)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds or best == float("inf"):
        best = min(best, once(a, b))
    return 2 * n ** 3 / best


def _vm_hwm_bytes() -> Optional[int]:
    """The process's resident-set high-water mark (``VmHWM`` of ``/proc/self/status``, Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_memory_bytes(device: Optional[torch.device] = None) -> tuple[str, int]:
    """``("cuda max allocated" | "peak RSS", bytes)`` for this process since the last :func:`reset_peak_memory`
    (or the start). On CPU: ``VmHWM`` on Linux, else ``getrusage``'s ``ru_maxrss`` (never reset)."""
    if device is not None and torch.device(device).type == "cuda":
        return "cuda max allocated", int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm_bytes()
    return "peak RSS", hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB


def reset_peak_memory(device: Optional[torch.device] = None) -> bool:
    """Start :func:`peak_memory_bytes` over from the memory in use now: ``torch.cuda.reset_peak_memory_stats`` on
    CUDA; on Linux CPU, ``5`` written to ``/proc/self/clear_refs`` (resets ``VmHWM``, Linux 4.0+, see proc(5)).
    Returns False where it cannot (the peak then keeps counting from the start)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def format_eta(seconds: float) -> str:
    seconds = int(round(max(0.0, seconds)))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def packed_padding(ids: torch.Tensor, position_ids, pad_id) -> torch.Tensor:
    """Pad tokens of packed rows ``ids`` ``[rows, row_len]``: per row, the length of its last document (from its last
    ``position_ids == 0``) when that document is all ``pad_id``. A 0-d int64 tensor on ``ids``' device (0 without
    position ids or pad id)."""
    if position_ids is None or pad_id is None or ids.dim() != 2:
        return torch.zeros((), dtype=torch.long, device=ids.device)
    pos = position_ids.expand_as(ids)
    idx = torch.arange(ids.shape[1], device=ids.device)
    last_start = torch.where(pos == 0, idx, 0).max(dim=1).values  # [rows]
    in_last = idx[None, :] >= last_start[:, None]
    all_pad = ((ids != pad_id) & in_last).sum(dim=1) == 0
    return torch.where(all_pad, ids.shape[1] - last_start, 0).sum()


class TokenCounter:
    """Forward pre-hook that adds up the tokens of every training forward pass.

    ``real`` = non-pad tokens: ``attention_mask.sum()``; with no mask (packed rows,
    :class:`sft.data.batches.packing.PackedCollator`) every token but the pad document that ends a row (its last
    document when it is all ``config.pad_token_id``); ``total`` = all positions computed, ``supervised`` = labels !=
    -100. Counts stay on the batch's device (no synchronisation per step) until :meth:`take` reads them.
    """

    def __init__(self):
        self._counts = None
        self.handle = None

    def attach(self, model: torch.nn.Module) -> "TokenCounter":
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def _hook(self, module, args, kwargs):
        if not module.training:
            return  # evaluation batches are not training throughput
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        mask, labels = kwargs.get("attention_mask"), kwargs.get("labels")
        if mask is not None and mask.dim() == 2:
            real = mask.sum()
        else:
            pad_id = getattr(getattr(module, "config", None), "pad_token_id", None)
            real = ids.numel() - packed_padding(ids, kwargs.get("position_ids"), pad_id)
        sup = (labels != -100).sum() if labels is not None else torch.zeros((), device=ids.device, dtype=torch.long)
        self._add(torch.stack([real.long(), torch.tensor(ids.numel(), device=ids.device), sup.long()]))

    def _add(self, new: torch.Tensor) -> None:
        self._counts = new if self._counts is None else self._counts + new.to(self._counts.device)

    def add_supervised(self, shift_labels: torch.Tensor) -> None:
        """Count the supervised targets (``shift_labels != -100``) of a training forward that was called without
        ``labels`` (the supervised-only LM head, :mod:`sft.model.loss`)."""
        sup = (shift_labels != -100).sum().long()
        self._add(torch.stack([torch.zeros_like(sup), torch.zeros_like(sup), sup]))

    def take(self) -> dict:
        """Counts since the last call: ``{"real", "total", "supervised"}`` (ints); resets them."""
        c = [0, 0, 0] if self._counts is None else self._counts.tolist()
        self._counts = None
        return dict(zip(("real", "total", "supervised"), c))


class ThroughputCallback(TrainerCallback):
    """Adds real tokens/s per device, padding ratio, MFU, peak memory and ETA to every training log line.

    Args:
        model: the model the Trainer trains (tokens are counted by a forward pre-hook on it).
        peak_flops: the device's peak FLOP/s for MFU; ``None`` measures a matmul peak at train start.
        dtype: compute dtype used for the measured peak (bf16 when training in bf16).
        supervised_head: the LM head runs only at supervised positions (:mod:`sft.model.loss`): its FLOPs
            (:func:`head_flops_per_token`) count per supervised target, the rest per real token.
    """

    def __init__(self, model: torch.nn.Module, peak_flops: Optional[float] = None,
                 dtype: torch.dtype = torch.float32, supervised_head: bool = False):
        self.counter = TokenCounter().attach(model)
        self.flops_per_token = model_flops_per_token(model)
        c = census(model)
        self.counted = (f"{len(c.experts)} routed expert layers at top_k / E = "
                        f"{min(k / e for _, e, k in c.experts):.3g}, " if c.experts else "")
        self.head_flops = head_flops_per_token(model) if supervised_head else 0
        self.peak_flops, self.dtype = peak_flops, dtype
        self.peak_source = "--peak_tflops" if peak_flops else None
        self.device = None
        self.load_peak, self.step_peak_separate = None, False  # bytes at train start; whether the peak was reset
        self._t, self._step = None, 0
        self.windows: list[dict] = []  # every window's figures with its token counts and seconds

    def on_train_begin(self, args, state, control, **kwargs):
        self.device = args.device
        if self.peak_flops is None and state.is_world_process_zero:
            self.peak_flops = measure_matmul_peak(self.dtype, self.device)
            self.peak_source = f"measured {str(self.dtype).replace('torch.', '')} matmul on {self.device.type}"
        if state.is_world_process_zero:
            logger.info("throughput: %.3g GFLOP per trained token (4 N_frozen + 6 N_trainable over the weights, %s"
                        "3x the state-carrying mixers; sft.train.counting); peak %.2f TFLOP/s (%s)",
                        self.flops_per_token / 1e9, self.counted, (self.peak_flops or 0) / 1e12, self.peak_source)
        # the peak of loading (weights, optimizer set-up) apart from the peak of the steps: the step lines below report
        # the peak since training started
        kind, self.load_peak = peak_memory_bytes(self.device)
        if torch.device(self.device).type == "cpu":
            trim_heap()  # what loading and set-up freed goes back to the system before the steps' peak is counted
        self.step_peak_separate = reset_peak_memory(self.device)
        if state.is_world_process_zero:
            logger.info("memory: %s %.2f GiB after loading%s", kind, self.load_peak / GIB,
                        "; the step lines give the peak of training alone" if self.step_peak_separate else "")
        self.counter.take()
        self._t, self._step = time.perf_counter(), state.global_step

    def window(self, state) -> Optional[dict]:
        """Figures since the previous call (or train start); ``None`` if no optimizer step happened."""
        now, steps = time.perf_counter(), state.global_step - self._step
        if self._t is None or steps <= 0:
            return None
        c, seconds = self.counter.take(), now - self._t
        self._t, self._step = now, state.global_step
        rate = c["real"] / seconds
        kind, mem = peak_memory_bytes(self.device)
        out = {"real_tokens_per_s": rate, "padding_ratio": 1 - c["real"] / max(1, c["total"]),
               "peak_mem_gib": mem / GIB, "eta_s": max(0, state.max_steps - state.global_step) * seconds / steps}
        if self.peak_flops:
            flops = (self.flops_per_token - self.head_flops) * c["real"] + self.head_flops * c["supervised"]
            out["mfu"] = flops / seconds / self.peak_flops
        self.last = {**out, "seconds": seconds, "steps": steps, "memory_kind": kind, **c}
        self.windows.append(self.last)
        return out

    def on_step_end(self, args, state, control, **kwargs):
        if self.device is not None and torch.device(self.device).type == "cpu":
            trim_heap()  # the step's freed activations go back to the system (else the next step's peak stacks on them)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return  # evaluation / final summary lines
        out = self.window(state)
        if out is None:
            return
        # ``logs`` is the dict the later callbacks (console printer, TensorBoard ...) receive; the Trainer
        # appended a copy to log_history just before, so keep that one in step too.
        logs.update(out)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(out)
        if state.is_world_process_zero:
            mfu = f"MFU {100 * out['mfu']:.1f}%, " if "mfu" in out else ""
            logger.info("step %d/%d: %.1f real tokens/s per device, padding %.1f%%, %s%s %.2f GiB, ETA %s",
                        state.global_step, state.max_steps, out["real_tokens_per_s"], 100 * out["padding_ratio"], mfu,
                        self.last["memory_kind"], out["peak_mem_gib"], format_eta(out["eta_s"]))

    def on_train_end(self, args, state, control, **kwargs):
        if self.counter.handle is not None:
            self.counter.handle.remove()
        if state.is_world_process_zero and self.load_peak is not None:
            kind, mem = peak_memory_bytes(self.device)
            logger.info("memory: %s %.2f GiB loading, %.2f GiB %s", kind, self.load_peak / GIB, mem / GIB,
                        "training" if self.step_peak_separate else "in all")
        # the loss curve is drawn after the final save (sft.app.train.save): drawing it here, on rank 0 alone, would
        # keep the other ranks waiting in the save's collectives for as long as matplotlib takes


def plot_loss_curve(log_history: list[dict], output_dir: str, name: str = "loss_curve.png") -> Optional[str]:
    """Write training (and evaluation) loss per optimizer step to ``<output_dir>/<name>``; return its path.

    Returns ``None`` (and logs why) when there is no loss to plot or matplotlib is missing.
    """
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h and "step" in h]
    if not train and not evals:
        logger.info("loss curve: no logged loss to plot (raise the number of steps or lower --logging_steps)")
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("loss curve: matplotlib is not installed; pip install matplotlib for loss_curve.png")
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for points, label, style in ((train, "training loss", ".-"), (evals, "evaluation loss", "o--")):
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean cross-entropy per supervised token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, name)
    fig.savefig(path)
    plt.close(fig)
    return path


PEAK_ENV = "SFT_PEAK_TFLOPS"  # the device's peak for MFU when --peak_tflops is not given (e.g. a cluster's profile)


def given_peak_tflops(flag: Optional[float]) -> tuple[Optional[float], Optional[str]]:
    """The device's peak TFLOP/s for MFU and where it came from: ``(flag, "--peak_tflops")``, else the environment's
    ``SFT_PEAK_TFLOPS`` (a cluster can state its accelerators' datasheet figure once for every job, and no job spends
    the ~1 s of the measurement), else ``(None, None)``: measured at train start (:func:`measure_matmul_peak`).
    An environment value that is no number is returned as NaN (refused by :func:`peak_tflops_problems`)."""
    if flag is not None:
        return flag, "--peak_tflops"
    text = os.environ.get(PEAK_ENV, "").strip()
    if not text:
        return None, None
    try:
        return float(text), PEAK_ENV
    except ValueError:
        return math.nan, PEAK_ENV


def peak_tflops_problems(flag: Optional[float]) -> list[str]:
    """One line when the given peak (:func:`given_peak_tflops`) is not a positive finite number, naming its source."""
    value, source = given_peak_tflops(flag)
    if value is None or (math.isfinite(value) and value > 0):
        return []
    shown = f"{source} {value}" if source == "--peak_tflops" else f"{source}={os.environ.get(PEAK_ENV)!r}"
    return [f"{shown}: must be a positive number of TFLOP/s (or leave it unset to measure)"]


def attach(trainer, peak_tflops: Optional[float] = None) -> ThroughputCallback:
    """Add a :class:`ThroughputCallback` to ``trainer`` ahead of the reporters, so that its figures reach the
    console printer and TensorBoard in the same log line. ``peak_tflops``: ``--peak_tflops`` (None: the
    environment's ``SFT_PEAK_TFLOPS``, else measured; :func:`given_peak_tflops`). ``trainer``: sft's
    :class:`sft.train.trainer.Trainer` (its ``supervised_head`` decides the FLOP count) or any
    ``transformers.Trainer`` (a peer's, in bench/compare.py: every position). Returns the callback."""
    dtype = torch.bfloat16 if trainer.args.bf16 else torch.float16 if trainer.args.fp16 else torch.float32
    supervised_head = bool(getattr(trainer, "supervised_head", False))  # a peer's Trainer has no such attribute
    peak_tflops, source = given_peak_tflops(peak_tflops)
    cb = ThroughputCallback(trainer.model, peak_tflops * 1e12 if peak_tflops else None, dtype, supervised_head)
    cb.peak_source = source if peak_tflops else None
    if supervised_head:
        trainer.supervised_counter = cb.counter
    trainer.callback_handler.callbacks.insert(0, cb)  # on_log runs in list order
    return cb
