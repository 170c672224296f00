"""Routing health in every training log line of a mixture-of-experts model.

A forward hook on every router (:func:`sft.model.routing.routers`) adds the top-k expert indices it chose to a
per-layer count of tokens per expert, on the router's device (``index_add_``: no host synchronisation per step).
The Trainer adds each micro batch's aux loss (:meth:`RoutingCounter.add_aux`, detached, on device). At each logging
step the window's counts are read once (one ``tolist``) and reset, and the log line (console, ``trainer_state.json``,
every ``--report_to`` reporter) gets:

* ``moe_aux_loss`` -- the mean of the window's micro-batch aux losses as the model computes them (before the
  coefficient; absent for a model without one);
* ``moe_max_load`` -- over the MoE layers, the largest ratio of the busiest expert's tokens to the mean tokens per
  expert (1: perfectly balanced; E / k: every token of that layer sent to the same k experts);
* ``moe_idle_experts`` -- expert slots (layer, expert) that got no token in the window.

Global rank 0 logs one ``routing:`` line with the figures per layer. Counts are this rank's (its tokens; the other
data-parallel ranks see samples of the same distribution). Training forwards only; a forward recomputed under
gradient checkpointing counts its tokens twice, which changes neither ratio nor which experts were idle.
"""
from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

from sft.model.routing import routers

logger = logging.getLogger("sft")


def _indices(output):
    """The integer tensor of top-k expert indices in a router's output tuple, or None."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    return next((t for t in items if torch.is_tensor(t) and not t.is_floating_point() and t.dtype != torch.bool),
                None)


class RoutingCounter:
    """Tokens per expert per MoE layer, and the aux losses, since the last :meth:`take`.

    Args:
        model: the trained model (any wrapper); hooks are put on its routers.
    """

    def __init__(self, model: torch.nn.Module):
        self.names, self.sizes, self.handles = [], [], []
        self.counts: list = []
        for i, (name, router, n_experts) in enumerate(routers(model)):
            self.names.append(name)
            self.sizes.append(n_experts)
            self.handles.append(router.register_forward_hook(self._hook(i)))
        self.counts = [None] * len(self.names)
        self._aux = None  # [sum, micro batches] on device

    def _hook(self, layer: int):
        def hook(module, args, output):
            if not module.training:
                return
            idx = _indices(output)
            if idx is None:
                return
            idx = idx.detach().reshape(-1)
            add = torch.zeros(self.sizes[layer], dtype=torch.float32, device=idx.device)
            add.index_add_(0, idx.long(), torch.ones(idx.numel(), dtype=torch.float32, device=idx.device))
            self.counts[layer] = add if self.counts[layer] is None else self.counts[layer] + add
        return hook

    def add_aux(self, aux) -> None:
        """Add one micro batch's aux loss (0-d tensor; not a tensor: ignored)."""
        if torch.is_tensor(aux):
            new = torch.stack([aux.detach().float().reshape(()), torch.ones((), device=aux.device)])
            self._aux = new if self._aux is None else self._aux + new.to(self._aux.device)

    def take(self) -> dict:
        """The window's figures, then reset: ``{"moe_max_load", "moe_idle_experts"[, "moe_aux_loss"]}`` and, under
        ``"layers"``, ``[(name, max/mean, [idle experts])]`` per layer that saw tokens. Empty if nothing was
        counted."""
        present = [(i, c) for i, c in enumerate(self.counts) if c is not None]
        out: dict = {}
        if present:
            device = present[0][1].device
            flat = torch.cat([c.to(device) for _, c in present]).tolist()  # the window's one host read
            layers, at = [], 0
            for i, _ in present:
                row, at = flat[at:at + self.sizes[i]], at + self.sizes[i]
                total = sum(row)
                if total > 0:
                    idle = [e for e, n in enumerate(row) if n == 0]
                    layers.append((self.names[i], max(row) * len(row) / total, idle))
            if layers:
                out = {"moe_max_load": max(r for _, r, _ in layers),
                       "moe_idle_experts": sum(len(z) for _, _, z in layers), "layers": layers}
        if self._aux is not None:
            total, n = self._aux.tolist()
            out["moe_aux_loss"] = total / max(1.0, n)
        self.counts, self._aux = [None] * len(self.names), None
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def routing_line(step: int, figures: dict) -> str:
    """The console line for one window's figures (:meth:`RoutingCounter.take`)."""
    aux = f"aux loss {figures['moe_aux_loss']:.4g}; " if "moe_aux_loss" in figures else ""
    per_layer = ", ".join(f"{r:.2f}" for _, r, _ in figures.get("layers", []))
    idle = "; ".join(f"{name}: {z}" for name, _, z in figures.get("layers", []) if z) or "none"
    return (f"routing at step {step}: {aux}busiest expert / mean per MoE layer [{per_layer}]; experts with no token "
            f"in the window: {idle}")


class RoutingHealthCallback(TrainerCallback):
    """Adds :meth:`RoutingCounter.take`'s scalar figures to every training log line and logs the per-layer line."""

    def __init__(self, counter: RoutingCounter):
        self.counter = counter

    def on_train_begin(self, args, state, control, **kwargs):
        self.counter.take()  # nothing before training (an evaluation on start) counts

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        figures = self.counter.take()
        scalars = {k: v for k, v in figures.items() if k != "layers"}
        logs.update(scalars)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(scalars)
        if figures and state.is_world_process_zero:
            logger.info("%s", routing_line(state.global_step, figures))

    def on_train_end(self, args, state, control, **kwargs):
        self.counter.remove()


def attach(trainer) -> "RoutingHealthCallback | None":
    """Put a :class:`RoutingHealthCallback` on ``trainer`` (ahead of the reporters) when its model has routers, and
    hand the counter to the Trainer for the aux losses (``trainer.routing_counter``). Returns it, or None for a dense
    model."""
    counter = RoutingCounter(trainer.model)
    if not counter.names:
        return None
    trainer.routing_counter = counter
    cb = RoutingHealthCallback(counter)
    trainer.callback_handler.callbacks.insert(0, cb)
    return cb
