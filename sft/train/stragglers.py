"""The training loop's progress beats and the straggler report (the watcher that reads the beats is
:mod:`sft.distributed.watchdog`).

:class:`ProgressCallback` marks the phase of every optimizer step in this process's
:data:`sft.distributed.watchdog.RECORD` (loading the next batch, forward and backward -- each micro batch is
progress --, optimizer step, logging, evaluation -- each batch is progress --, saving a checkpoint), from the
Trainer's callbacks and a forward pre-hook on the model. It sits last among the callbacks, so that it sees the
final ``should_log`` / ``should_evaluate`` / ``should_save`` of a step.

Stragglers: each rank times its own forward passes (a forward pre-hook and hook on the model; CUDA events on the
current stream on CUDA, read once done -- no synchronisation --, ``time.perf_counter`` on CPU) and counts their
tokens (``input_ids.numel()``). The forward pass is the closest honest measure of a rank's own work that needs no
hook inside the communication: under DDP (and ZeRO-1/2) it runs no collective -- DDP's buffer broadcast runs
before the module's forward, outside the timing -- while backward overlaps the gradient all-reduce and ends in
the wait for the slowest rank, which makes every rank's step time equal. Under ZeRO-3 and FSDP the forward's
parameter all-gathers are inside the timing. Per token, so that ranks given micro batches of different sizes
compare fairly. Over the last ``--straggler_window`` optimizer steps (full windows only, the first
:data:`WARMUP_STEPS` steps after a start left out) each rank publishes its milliseconds per 1,000
tokens (sums over the window: a rank stopped part of the time is slowed on average, not in the median step);
at every logging step global rank 0 compares each rank's milliseconds per 1,000 tokens with the median of the
other ranks' (leave-one-out: with two ranks the other's own figure) and names a rank at ``--straggler_factor``
or more in one line (rank, host, its figure, the median), adds ``straggler_ratio`` (slowest / median of the
others), ``straggler_rank``, ``forward_ms_per_1k_tokens_slowest`` and ``forward_ms_per_1k_tokens_median`` to
the log line (console, TensorBoard), and at the end of training lists every rank it ever named.
"""
from __future__ import annotations

import collections
import logging
import os
import statistics
import time
from typing import Optional

import torch
from transformers import TrainerCallback

from sft.distributed import watchdog
from sft.distributed.watchdog import EVALUATION, FORWARD_BACKWARD, LOADING_BATCH, LOGGING, OPTIMIZER, RECORD, SAVING

logger = logging.getLogger("sft")
# optimizer steps after each start left out of the straggler window: measured in the cluster tier under load, the
# first window (steps 1-5) named an even run's rank at 1.53x; its later windows stayed at or under 1.28x
WARMUP_STEPS = 2

_SCHEDSTAT: dict = {}  # thread id -> an open descriptor of that thread's /proc/thread-self/schedstat (or -1)


def run_delay_ns() -> int:
    """Nanoseconds the calling thread has spent runnable but waiting for a CPU (Linux ``/proc/thread-self/schedstat``,
    second field: the scheduler's run-queue delay), or 0 where that file is not available. The file stays open per
    thread (one ``pread`` per call: a few microseconds)."""
    import threading

    tid = threading.get_ident()
    fd = _SCHEDSTAT.get(tid)
    if fd is None:
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            fd = -1
        _SCHEDSTAT[tid] = fd
    if fd < 0:
        return 0
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def median_of_others(values: dict, rank: int) -> Optional[float]:
    """The median of ``values`` (rank -> number) without ``rank``'s own, or None when no other rank has one."""
    rest = [v for r, v in values.items() if r != rank]
    return statistics.median(rest) if rest else None


class ForwardTimer:
    """Milliseconds and tokens of this process's training forward passes since the last :meth:`take`.

    On CUDA a pair of timing events per forward on the current stream, resolved when the end event has completed
    (:meth:`take` leaves unfinished pairs for the next call). On CPU ``time.perf_counter`` less the time the
    training thread waited for a CPU that other processes held (:func:`run_delay_ns`): on a host with more busy
    processes than cores that wait moves from rank to rank (measured on 2 cores with 4 busy processes: windows of 20
    steps at up to 2.4x the other rank's median on an even run); a rank that runs slower, or is stopped part of
    the time (SIGSTOP, a frozen VM), still shows.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.ms = 0.0
        self.tokens = 0
        self.pending: list = []
        self._t0: Optional[float] = None
        self._d0 = 0
        self._e0 = None

    def start(self, tokens: int) -> None:
        self.tokens += tokens
        if self.cuda:
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e0.record()
        else:
            self._t0, self._d0 = time.perf_counter(), run_delay_ns()

    def stop(self) -> None:
        if self.cuda and self._e0 is not None:
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
            self.pending.append((self._e0, e1))
            self._e0 = None
        elif self._t0 is not None:
            self.ms += max(0.0, 1000 * (time.perf_counter() - self._t0) - (run_delay_ns() - self._d0) / 1e6)
            self._t0 = None

    def take(self) -> tuple:
        """``(ms, tokens)`` since the last call (CUDA: of the forwards finished on the device by now)."""
        if self.pending:
            done = [(a, b) for a, b in self.pending if b.query()]
            self.pending = [p for p in self.pending if p not in done]
            self.ms += sum(a.elapsed_time(b) for a, b in done)
        out = (self.ms, self.tokens)
        self.ms, self.tokens = 0.0, 0
        return out


def _tokens(args, kwargs) -> int:
    ids = kwargs.get("input_ids") if kwargs else None
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0


def compare(work: dict, factor: float) -> Optional[dict]:
    """The straggler figures for ``work`` (global rank -> ``{"rate", "n", "first", "last"}``: each rank's forward
    milliseconds per 1,000 tokens over its window, steps ``first``-``last``): the slowest rank against the median of the
    others, and the ranks at ``factor`` times that median or more (``factor`` 0: none named). None with fewer than
    two ranks with a figure."""
    rate = {r: float(w["rate"]) for r, w in work.items() if w and w.get("rate")}
    if len(rate) < 2:
        return None
    ratios = {r: rate[r] / m for r in rate if (m := median_of_others(rate, r))}
    if not ratios:
        return None
    slowest = max(ratios, key=lambda r: (ratios[r], -r))
    return {"rate": rate, "ratios": ratios, "slowest": slowest, "median": median_of_others(rate, slowest),
            "named": sorted(r for r, x in ratios.items() if factor and x >= factor)}


class ProgressCallback(TrainerCallback):
    """Phase marks and the straggler report; see the module docstring.

    Args:
        model: the model whose forward passes are timed (``trainer.model``, hooked before any wrapper).
        factor: ``--straggler_factor`` (0: no report).
        window: ``--straggler_window`` optimizer steps.
    """

    def __init__(self, model: torch.nn.Module, factor: float, window: int):
        self.model, self.factor, self.window = model, float(factor), int(window)
        self.timer = ForwardTimer(torch.cuda.is_available())
        self.steps: collections.deque = collections.deque(maxlen=self.window)
        self.handles: list = []
        self.named: dict = {}  # rank -> {"host", "times", "worst", "steps"}
        self.warmup = WARMUP_STEPS
        self.last_figures: Optional[dict] = None

    # ---- forward hooks ---------------------------------------------------------------------------------------
    def _pre(self, module, args, kwargs):
        if module.training:
            state_step = RECORD.step
            if RECORD.phase != FORWARD_BACKWARD:
                RECORD.set(FORWARD_BACKWARD, state_step)
            else:
                RECORD.advance()
            if self.factor:
                self.timer.start(_tokens(args, kwargs))
        else:
            RECORD.advance()  # an evaluation batch

    def _post(self, module, args, output):
        if module.training and self.factor:
            self.timer.stop()

    def on_train_begin(self, args, state, control, **kwargs):
        self.warmup = WARMUP_STEPS
        self.handles = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                        self.model.register_forward_hook(self._post)]
        RECORD.set(LOADING_BATCH, state.global_step + 1)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        RECORD.set(OPTIMIZER, state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self.factor:
            ms, tokens = self.timer.take()
            if self.warmup > 0:  # the first steps after a start carry one-time costs (allocations, lazy setup)
                self.warmup -= 1
                ms = tokens = 0
        if self.factor and tokens:
            self.steps.append((state.global_step, ms, tokens))
            tokens = sum(s[2] for s in self.steps)
            if tokens:
                RECORD.work = {"rate": 1000 * sum(s[1] for s in self.steps) / tokens, "n": len(self.steps),
                               "first": self.steps[0][0], "last": self.steps[-1][0]}
        self._after(control, state.global_step, LOGGING if control.should_log else None)

    def _after(self, control, step: int, first: Optional[str]) -> None:
        """The phase that follows: logging, evaluation, saving (of ``step``), else loading the next step's batch."""
        phase = first or (EVALUATION if control.should_evaluate else SAVING if control.should_save else None)
        if phase:
            RECORD.set(phase, step)
        else:
            RECORD.set(LOADING_BATCH, step + 1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._after(control, state.global_step, None)

    def on_prediction_step(self, args, state, control, **kwargs):
        RECORD.advance()

    def on_evaluate(self, args, state, control, **kwargs):
        self._after(control, state.global_step, SAVING if control.should_save else None)

    def on_save(self, args, state, control, **kwargs):
        RECORD.set(LOADING_BATCH, state.global_step + 1)

    def on_train_end(self, args, state, control, **kwargs):
        for h in self.handles:
            h.remove()
        self.handles = []
        RECORD.set("finishing (final evaluation and save)", state.global_step)
        if state.is_world_process_zero and self.factor and watchdog.current() is not None:
            if self.named:
                logger.warning("stragglers named during training: %s", "; ".join(
                    f"rank {r} (host {n['host']}) {n['times']} time(s), at most {n['worst']:.2f}x the median of the "
                    f"other ranks (steps {n['steps'][0]}-{n['steps'][-1]})" for r, n in sorted(self.named.items())))
            else:
                logger.info("stragglers: none named (--straggler_factor %g over %d-step windows)", self.factor,
                            self.window)

    # ---- the report (global rank 0, at every logging step) ---------------------------------------------------
    def figures(self, state) -> Optional[dict]:
        """Compare the ranks' latest windows; log a line per straggler; return the figures for the log line."""
        watcher = watchdog.current()
        if watcher is None or not self.factor:
            return None
        beats = watcher.beats()
        work = {r: b.get("work") for r, b in beats.items() if b.get("work") and b["work"].get("n", 0) >= self.window}
        result = compare(work, self.factor)
        if result is None:
            return None
        for r in result["named"]:
            w, host = work[r], beats[r]["host"]
            ratio = result["ratios"][r]
            logger.warning("straggler: rank %d (host %s) took %.2fx the median of the other ranks over steps %d-%d: "
                           "forward %.1f ms per 1,000 tokens against %.1f ms; every rank waits for it at each "
                           "gradient all-reduce (a throttled or slower device, a busy host, a slow link)", r, host,
                           ratio, w["first"], w["last"], result["rate"][r], median_of_others(result["rate"], r))
            n = self.named.setdefault(r, {"host": host, "times": 0, "worst": 0.0, "steps": []})
            n["times"] += 1
            n["worst"] = max(n["worst"], ratio)
            n["steps"].append(state.global_step)
        s = result["slowest"]
        self.last_figures = {"straggler_ratio": result["ratios"][s], "straggler_rank": s,
                             "forward_ms_per_1k_tokens_slowest": result["rate"][s],
                             "forward_ms_per_1k_tokens_median": result["median"]}
        return self.last_figures


class _FiguresFirst(TrainerCallback):
    """Puts the straggler figures into a training log line before the reporters (console, TensorBoard) see it."""

    def __init__(self, owner: ProgressCallback):
        self.owner = owner

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or not state.is_world_process_zero:
            return
        out = self.owner.figures(state)
        if out:
            logs.update(out)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(out)


def attach(trainer, factor: float, window: int) -> ProgressCallback:
    """Add the :class:`ProgressCallback` last among ``trainer``'s callbacks (it reads the step's final flags) and
    its figures' hook first (ahead of the reporters). Returns the callback."""
    cb = ProgressCallback(trainer.model, factor, window)
    trainer.callback_handler.callbacks.append(cb)
    trainer.callback_handler.callbacks.insert(0, _FiguresFirst(cb))
    return cb
