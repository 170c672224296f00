"""sft.distributed.torchrun: torchrun's main with a quiet exit on a signal (finetune/launch.sh starts it)."""
import logging
import signal
import subprocess
import sys

import pytest

from sft.distributed import torchrun


def test_signal_is_a_quiet_exit_code(monkeypatch, capsys):
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    seen = []

    def stopped(argv):
        seen.append(argv)
        logging.getLogger(torchrun._AGENT_LOGGER).warning("Received 15 death signal, shutting down workers")
        raise SignalException("got signal", sigval=signal.SIGTERM)

    monkeypatch.setattr(run, "main", stopped)
    assert torchrun.main(["--nproc_per_node", "2", "train.py", "--x", "1"]) == 128 + signal.SIGTERM
    assert seen == [["--nproc_per_node", "2", "train.py", "--x", "1"]]  # arguments passed through unchanged
    assert "death signal" not in capsys.readouterr().err


def test_other_outcomes_are_torchruns(monkeypatch):
    from torch.distributed import run

    monkeypatch.setattr(run, "main", lambda argv: None)
    assert torchrun.main(["x.py"]) == 0

    def failed(argv):
        raise SystemExit(1)

    monkeypatch.setattr(run, "main", failed)
    with pytest.raises(SystemExit) as e:
        torchrun.main(["x.py"])
    assert e.value.code == 1


def test_bad_arguments_exit_like_torchrun():
    r = subprocess.run([sys.executable, "-m", "sft.distributed.torchrun", "--nproc_per_node", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "the following arguments are required: training_script" in r.stderr, r.stderr
