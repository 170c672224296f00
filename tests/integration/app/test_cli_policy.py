"""The one CLI policy (sft.cli.run_cli): message, exit code, SFT_DEBUG, rank prefix; the check command."""
import pytest

from sft.cli import check_main, rank_prefix, run_cli
from sft.distributed.failures import PeerLost
from sft.errors import PREEMPTED_EXIT_CODE, ConfigError, SFTError
from sft.train.preemption import Preempted


@pytest.mark.parametrize("err,code,label", [
    (ConfigError(["--lora_r 0: bad"]), 2, "error: invalid configuration"),
    (Preempted("stopped by SIGTERM at step 3"), PREEMPTED_EXIT_CODE, "preempted: stopped by SIGTERM"),
    (PeerLost("training stopped: another process of the job went away"), 1, "error: training stopped"),
])
def test_errors_become_one_paragraph_and_their_exit_code(err, code, label, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("SFT_DEBUG", raising=False)
    codes = tmp_path / "codes"  # finetune/launch.sh's SFT_EXIT_CODE_FILE: every rank's code of an error
    monkeypatch.setenv("SFT_EXIT_CODE_FILE", str(codes))

    def body():
        raise err
    assert run_cli(body) == code
    err_text = capsys.readouterr().err
    assert err_text.startswith(label) and "Traceback" not in err_text
    assert codes.read_text() == f"{code}\n"


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("SFT_DEBUG", "1")
    with pytest.raises(SFTError):
        run_cli(lambda: (_ for _ in ()).throw(SFTError("boom")))
    monkeypatch.setenv("SFT_DEBUG", "0")  # 0 means off
    assert run_cli(lambda: (_ for _ in ()).throw(SFTError("boom"))) == 2


def test_rank_prefix_and_return_values(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("SFT_DEBUG", raising=False)
    assert rank_prefix() == "[rank 3] "
    assert run_cli(lambda: (_ for _ in ()).throw(SFTError("x"))) == 2
    assert capsys.readouterr().err.startswith("[rank 3] error: x")
    monkeypatch.setenv("RANK", "0")
    assert rank_prefix() == ""
    assert run_cli(lambda: "a path") == 0 and run_cli(lambda: 7) == 7


def test_check_command(tiny_model_dir, toy_data, tmp_path, capsys):
    base = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "o"), "--report_to", "none"]
    assert check_main(base + ["--data_path", toy_data]) == 0
    err = capsys.readouterr().err
    assert f"check: {toy_data}: 8 valid conversations" in err and "check: configuration and data OK" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    assert check_main(base + ["--data_path", str(bad)]) == 2
    assert "no assistant turn" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # a check writes nothing


def test_only_torch_distributed_failures_become_peer_lost():
    """A user error that mentions gloo stays a user error (exit 2); a gloo connection loss becomes PeerLost."""
    import torch.distributed as dist

    from sft.distributed.failures import raise_if_peer_lost

    raise_if_peer_lost(ConfigError(["--ddp_backend gloo: not with --fp16"]), 60, {})  # returns, nothing raised
    raise_if_peer_lost(ValueError("unrelated"), 60, {})
    with pytest.raises(PeerLost, match="another process of the job went away; the peer was 10.0.0.7"):
        raise_if_peer_lost(dist.DistBackendError("Connection closed by peer [10.0.0.7]:4000"), 60, {})
