"""Test worker run in place of finetune.py (directly, or under torchrun; tests/integration/train/test_async_save.py):
trains through :func:`sft.cli.train_main` with a fault injected into one background checkpoint write
(``--save_async True``, sft/train/async_save.py).

``SFT_TEST_FAULT=KIND:STEP``: the background write of ``checkpoint-STEP`` writes its first file (the weights or
adapter), then

* ``kill``: this process sends itself SIGKILL (a crash in the middle of the write);
* ``term``: this process sends itself SIGTERM (a scheduler's preemption) and the write goes on 1 s later, so that
  the next step ends while it is still in flight.

Only ranks with files to write (the saving process) inject the fault.
"""
import os
import signal
import sys
import time

from sft.compat.bitsandbytes import keep_out_unless_needed

keep_out_unless_needed(sys.argv[1:])  # before peft is imported, as finetune.py does (sft.cli.train_command)

from sft.cli import exit_process, train_main  # noqa: E402
from sft.train import async_save  # noqa: E402


def main() -> int:
    kind, step = os.environ["SFT_TEST_FAULT"].split(":")
    start = async_save.BackgroundSaves.start

    def fault():
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)

    def start_with_fault(self, path, complete):
        if os.path.basename(path) == f"checkpoint-{step}" and self.jobs:
            self.jobs.insert(1, ("fault", fault))
        return start(self, path, complete)

    async_save.BackgroundSaves.start = start_with_fault
    return train_main(sys.argv[1:])


if __name__ == "__main__":
    exit_process(main())  # as finetune.py ends
