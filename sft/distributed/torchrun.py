"""torchrun (``torch.distributed.run``) as ``finetune/launch.sh`` starts it, with quiet ends on a signal or a failed worker.

``python -m sft.distributed.torchrun ARGS`` is ``python -m torch.distributed.run ARGS`` except for what two
outcomes print:

- A signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT: a preemption, a scheduler's stop): torchrun's agent stops its
  workers exactly as before (it passes the signal on and waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds,
  during which sft's workers save a checkpoint), but instead of logging "Received 15 death signal" and a
  Python traceback of its ``SignalException`` per node, this exits quietly with 128 + the signal number
  (143 for SIGTERM), the code a shell gives a process ended by that signal; the launcher turns it into 75
  when a worker saved a checkpoint.
- A failed worker (torchrun's ``ChildFailedError``, e.g. a rank that stopped because a peer node died):
  instead of torchrun's traceback and its "finetune.py FAILED" report, one line on stderr,
  ``torchrun: global rank R (local rank L on this node, pid P) exited with code C; ...`` naming where the
  worker's own output is, and the exit code is the worker's (128 + the signal number for a worker ended by
  a signal), so a scheduler sees the worker's code.

- The exit barrier broken off (torch 2.13's agent logs "Error waiting on exit barrier" with a traceback when
  the rendezvous store, served by the master node's launcher, closed while this node's launcher still waited
  on it at the end of a run: a race at every multi-node end): one line instead, saying that this node's
  workers had finished, so their result stands.

Every other outcome (success, a bad flag) is torchrun's own, unchanged.
"""
from __future__ import annotations

import logging
import signal
import sys
from typing import Optional

from ..errors import report_exit_code

# torch 2.13: the agent logs its "Received N death signal, shutting down workers" on this logger, then
# re-raises SignalException (torch.distributed.elastic.multiprocessing.api) out of torchrun's main().
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
# ... and the process handler logs "failed (exitcode: C) local_rank: L (pid: P) of binary: ..." on this one
# before the agent raises ChildFailedError: the line below says the same with the global rank.
_PROCS_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def _not_failed_report(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("failed (exitcode")


def _exit_barrier_line(record: logging.LogRecord) -> bool:
    """The agent's "Error waiting on exit barrier" record as one line, without its traceback."""
    if str(record.msg).startswith("Error waiting on exit barrier") and record.exc_info:
        err = record.exc_info[1]
        first = str(err).splitlines()[0][:200] if str(err) else ""
        record.msg = ("torchrun: the exit barrier with the other nodes' launchers broke off (%s: %s): the "
                      "rendezvous store on the master node had closed, its launcher already gone; this node's "
                      "workers had finished, so their result stands")
        record.args = (type(err).__name__, first)
        record.exc_info, record.exc_text = None, None
    return True


def _log_location(argv: list[str]) -> str:
    """Where torchrun puts a worker's output: this process's stdout/stderr unless ``--log-dir`` (with
    ``--redirects``/``--tee``) sends it to files."""
    for i, a in enumerate(argv):
        if a.split("=")[0] in ("--log-dir", "--log_dir"):
            d = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            return f"its output is under {d} (torchrun's --log-dir) and above in this log"
        if not a.startswith("-"):  # the training script: the flags after it are its own
            break
    return "its output (the first error) is above in this log: the workers write to this launcher's stdout/stderr"


def failure_line(err, argv: list[str]) -> tuple[str, int]:
    """(one line for the log, exit code) for torchrun's ``ChildFailedError`` ``err``: the first worker that
    failed (by its failure time), by global rank, local rank, pid and exit code. The code is the worker's,
    128 + N for a worker ended by signal N (torch reports those as -N)."""
    rank, failure = err.get_first_failure()
    code = int(failure.exitcode)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how, code = f"was ended by {name}", 128 - code
    else:
        how = f"exited with code {code}"
    others = len(err.failures) - 1
    more = f" ({others} other worker(s) of this node stopped after it)" if others > 0 else ""
    line = (f"torchrun: global rank {rank} (local rank {failure.local_rank} on this node, pid {failure.pid}) "
            f"{how}{more}; {_log_location(argv)}")
    return line, code




def main(argv: Optional[list[str]] = None) -> int:
    """Runs torchrun with ``argv`` (default ``sys.argv[1:]``); its exit code: 0, 128 + signal number when a
    signal stopped it, the first failed worker's code (one line on stderr says which); also written as
    ``torchrun CODE`` to ``SFT_EXIT_CODE_FILE`` when that is set. Raises SystemExit as torchrun does for bad
    arguments."""
    code = _run(argv)
    report_exit_code(code, "torchrun")
    return code


def _run(argv: Optional[list[str]]) -> int:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = sys.argv[1:] if argv is None else argv
    logging.getLogger(_AGENT_LOGGER).setLevel(logging.ERROR)
    logging.getLogger(_AGENT_LOGGER).addFilter(_exit_barrier_line)
    logging.getLogger(_PROCS_LOGGER).addFilter(_not_failed_report)
    try:
        run.main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        # the workers are gone; a signal now (a scheduler ending the other nodes' steps after this failure)
        # must not turn the worker's code into torchrun's SignalException
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(s, signal.SIG_IGN)
        line, code = failure_line(e, argv)
        print(line, file=sys.stderr, flush=True)
        return code if code != 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
