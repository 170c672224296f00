"""torchrun (``torch.distributed.run``) as ``finetune/launch.sh`` starts it, with a quiet stop on a signal.

``python -m sft.distributed.torchrun ARGS`` is ``python -m torch.distributed.run ARGS`` except for what a
signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT: a preemption, a scheduler's stop) prints: torchrun's agent then
stops its workers exactly as before (it passes the signal on and waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
seconds, during which sft's workers save a checkpoint), but instead of logging "Received 15 death signal"
and a Python traceback of its ``SignalException`` per node, this exits quietly with 128 + the signal number
(143 for SIGTERM), the code a shell gives a process ended by that signal; the launcher turns it into 75
when a worker saved a checkpoint. Every other outcome (success, a failed worker, a bad flag) is torchrun's
own, unchanged.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional

# torch 2.13: the agent logs its "Received N death signal, shutting down workers" on this logger, then
# re-raises SignalException (torch.distributed.elastic.multiprocessing.api) out of torchrun's main().
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


def main(argv: Optional[list[str]] = None) -> int:
    """Runs torchrun with ``argv`` (default ``sys.argv[1:]``); its exit code, 128 + signal number when a
    signal stopped it. Raises SystemExit as torchrun does for bad arguments or failed workers."""
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    logging.getLogger(_AGENT_LOGGER).setLevel(logging.ERROR)
    try:
        run.main(sys.argv[1:] if argv is None else argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
