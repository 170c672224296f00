"""bench/fault_drill.py without namespaces or training: its refusal when not root (exit 2, one line), the kill steps
its --seed draws, and that the lines it looks for in the logs are the ones sft writes (the fallback past a checkpoint
whose adapter bytes it flipped, the full-disk paragraph). The drill itself is run by hand (docs/benchmarks.md)."""
from __future__ import annotations

import errno
import logging
import os

import pytest
import torch
from safetensors.torch import save_file

from sft.train import checkpoint as ck
from sft.train.integrity import out_of_space_message
from tests.helpers.paths import load_bench_module


@pytest.fixture(scope="module")
def drill():
    return load_bench_module("fault_drill")


def test_refuses_without_root_with_exit_2_and_one_line(drill, monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert drill.main(["--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err and "Traceback" not in err


@pytest.mark.parametrize("seed", range(20))
def test_the_seed_draws_5_increasing_kill_steps_after_the_first_checkpoint_and_apart(drill, seed):
    steps = drill.draw_kill_steps(seed, 140, 10, 45)
    assert steps == drill.draw_kill_steps(seed, 140, 10, 45)  # the same seed, the same drill
    assert len(steps) == 5 and steps[0] > drill.SAVE_STEPS and steps[-1] <= 140 - 3 * drill.SAVE_STEPS
    assert [b - a >= g for a, b, g in zip(steps, steps[1:], (45, 10, 45, 10))] == [True] * 4


def test_the_seeds_draw_different_steps_and_too_few_steps_are_refused(drill):
    assert len({tuple(drill.draw_kill_steps(s, 140, 10, 45)) for s in range(20)}) > 10
    with pytest.raises(SystemExit, match=r"--steps 100 leaves no room for 5 kills after step 5 with gaps \[45, 10, 45, "
                                         r"10\]; give --steps 127 or more"):
        drill.draw_kill_steps(0, 100, 10, 45)


def _checkpoint(out, step):
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text('{"global_step": %d}' % step)
    save_file({"lora_A": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, str(path / "adapter_model.safetensors"))
    ck.mark_complete(str(path), {"world_size": 1})
    return str(path)


def test_a_flipped_adapter_byte_gives_the_fallback_line_the_drill_looks_for(drill, tmp_path, caplog):
    old, new = _checkpoint(tmp_path, 4), _checkpoint(tmp_path, 8)
    at = drill.flip_a_byte(os.path.join(new, "adapter_model.safetensors"))
    header = int.from_bytes(open(os.path.join(new, "adapter_model.safetensors"), "rb").read(8), "little")
    assert at >= 8 + header  # in the tensor data, not the header
    assert drill.newest_verified(str(tmp_path)) == old
    with caplog.at_level(logging.WARNING, logger="sft"):
        assert ck.choose_resume(str(tmp_path), None, False) == old
    assert any(drill.fallback_line(new, old).search(r.getMessage()) for r in caplog.records), caplog.text
    assert not drill.fallback_line(old, new).search(caplog.text)


def test_the_full_disk_paragraph_is_the_one_the_drill_looks_for(drill, tmp_path):
    kept = _checkpoint(tmp_path, 4)
    target = str(tmp_path / "checkpoint-8" / "adapter_model.safetensors")
    err = OSError(errno.ENOSPC, "No space left on device", target)
    m = drill.OUT_OF_SPACE.search("ERROR " + out_of_space_message(err, str(tmp_path), kept))
    assert m is not None and m.groups() == (target, kept)
