"""Preemption: on SIGTERM or SIGINT, finish the optimizer step, save a checkpoint, exit with code 75.

SIGTERM is what SLURM sends before a kill (``--signal``, time limit, ``scancel``), what Kubernetes and
spot/preemptible VMs send, and what torchrun's agent forwards to its workers when it is itself
signalled (it then waits ``--shutdown_timeout`` / ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds, default 30,
before SIGKILL; ``finetune/launch.sh`` raises that to this module's deadline plus a margin).

* The handler only sets a flag (safe at any point of a step). Repeated signals are ignored: under
  torchrun a Ctrl-C reaches a worker twice (from the terminal and from the agent).
* At the end of every optimizer step the ranks agree on the flag with one all-reduce (MAX of one
  integer): the signal may reach only some ranks, and all must stop at the same step or the next
  collective would hang. Then the Trainer saves a checkpoint (``control.should_save``) and stops.
* A watchdog started by the first signal ends the process with :data:`PREEMPTED_EXIT_CODE` after
  ``--preemption_timeout`` seconds whatever it is doing (a peer that died, a save that hangs). A
  checkpoint cut short there has no completion marker, so ``auto`` resume takes the previous one.

Launchers that cannot deliver a signal to the training thread (Ray Train runs the training function in
a thread of its worker actor, where Python cannot install signal handlers) call :func:`request_stop`,
which has exactly the effect of a signal on this process.

Transformers' own ``enable_jit_checkpoint`` is not used: it checks the flag on each rank separately
(ranks can stop at different steps), can save before the optimizer step of the current batch, and
leaves the exit code to the caller.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable, Optional, Sequence

from transformers import TrainerCallback

from sft.distributed.collectives import any_rank
from sft.errors import PREEMPTED_EXIT_CODE, SFTError, report_exit_code

logger = logging.getLogger("sft")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The installed handler of the training running in this process: signals are process-wide, and request_stop()
# (called from another thread, e.g. the Ray stop poller) must reach the one training of the process.
_ACTIVE: Optional["PreemptionHandler"] = None


class Preempted(SFTError):
    """Training stopped on a signal after saving a checkpoint; the same command resumes it."""

    exit_code = PREEMPTED_EXIT_CODE


class PreemptionHandler(TrainerCallback):
    """Signal handlers + the per-step agreement; see the module docstring.

    Args:
        timeout_s: seconds from the first signal to a forced exit with :data:`PREEMPTED_EXIT_CODE`.
        step_checks: callables run on every rank at the end of every optimizer step, before the ranks agree on
            stopping; a truthy result (a text saying why) stops training as SIGTERM would. Every rank must get the
            same checks: a check may be a collective (Ray Train's ``get_preemption_info`` is a barrier).
    """

    def __init__(self, timeout_s: float = 300.0, step_checks: Sequence[Callable[[], Optional[str]]] = ()):
        self.timeout_s = float(timeout_s)
        self.step_checks = tuple(step_checks)
        self.signum: Optional[int] = None  # first signal received by this process
        self.cause: Optional[str] = None  # what stopped it when not a signal (a step check's reason)
        self.stopped_at: Optional[int] = None  # global step at which all ranks agreed to stop
        self._previous = {}
        self._watchdog: Optional[threading.Timer] = None

    # ---- signals -------------------------------------------------------------------------------
    def install(self) -> "PreemptionHandler":
        """Install the signal handlers (only on the main thread, the only one Python lets handle signals;
        elsewhere :func:`request_stop` is the way in) and make this the process's active handler. Returns self."""
        global _ACTIVE
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        _ACTIVE = self
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers and cancel the watchdog (the run is over)."""
        global _ACTIVE
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
        if _ACTIVE is self:
            _ACTIVE = None
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _on_signal(self, signum, frame):
        if self.signum is not None:
            return
        self.signum = signum
        # os.write: no locks in a signal handler (the logging module takes some)
        rank = os.environ.get("RANK", "0")
        os.write(2, (f"[sft rank{rank}] WARNING received {signal.Signals(signum).name}: finishing the current "
                     f"optimizer step, then saving a checkpoint (exit {PREEMPTED_EXIT_CODE}; forced after "
                     f"{self.timeout_s:g} s)\n").encode())
        self._watchdog = threading.Timer(self.timeout_s, self._force_exit)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _force_exit(self):
        rank = os.environ.get("RANK", "0")
        os.write(2, (f"[sft rank{rank}] ERROR preemption: no clean stop within {self.timeout_s:g} s (--preemption_"
                     f"timeout); exiting with {PREEMPTED_EXIT_CODE}; the last complete checkpoint is kept\n").encode())
        report_exit_code(PREEMPTED_EXIT_CODE)
        os._exit(PREEMPTED_EXIT_CODE)

    # ---- Trainer callback ----------------------------------------------------------------------
    def _agreed(self, args) -> bool:
        return any_rank(self.signum is not None, device=args.device)  # on the Trainer's device: NCCL wants CUDA

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is None:
            # on every rank at every step, even once signalled: a check may be a collective
            for check in self.step_checks:
                reason = check()
                if reason and self.signum is None:
                    logger.warning("preemption notice (rank %s): %s", os.environ.get("RANK", "0"), reason)
                    self.cause = str(reason)
                    self._on_signal(signal.SIGTERM, None)
        if self.stopped_at is None and self._agreed(args):
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
            logger.warning("preemption: saving a checkpoint at step %d and stopping", state.global_step)
        return control

    @property
    def preempted(self) -> bool:
        return self.stopped_at is not None


def request_stop(signum: int = signal.SIGTERM) -> bool:
    """Act as if this process had received ``signum``: the running training saves a checkpoint at the end of
    the current optimizer step and stops (:class:`Preempted`, exit code 75). Thread-safe; repeated calls are
    ignored like repeated signals. Returns False when no training is running in this process."""
    handler = _ACTIVE
    if handler is None:
        return False
    handler._on_signal(signum, None)
    return True


