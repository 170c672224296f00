"""Background checkpoint writes (``--save_async``, sft/train/async_save.py) in one process: the staged copy is
independent of training and keeps tied tensors tied, a PEFT adapter written from the staged copy is the file the
synchronous save writes, and a failed background write leaves no marker and raises at the next wait. Real training
runs (kill -9 and SIGTERM during a background write, a full disk, FSDP2 shards) are in
tests/integration/train/test_resume.py, tests/integration/train/test_checkpoint_integrity.py and
tests/integration/distributed/test_fsdp.py."""
import errno
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from sft.train import checkpoint as ck
from sft.train.async_save import BackgroundSaves, stage, staged_bytes


def test_staged_copy_is_independent_keeps_ties_views_and_other_values():
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"embed": weight, "lm_head": weight, "row": weight[1], "step": 7,
             "groups": [{"lr": 0.1, "params": [0, 1]}], "pair": (weight[:, 1], "x")}
    memo = {}
    copy = stage(state, memo=memo)
    weight.add_(100)  # training goes on
    assert torch.equal(copy["embed"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert copy["embed"].untyped_storage().data_ptr() == copy["lm_head"].untyped_storage().data_ptr()
    assert copy["embed"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    assert torch.equal(copy["row"], torch.tensor([4.0, 5, 6, 7]))
    assert torch.equal(copy["pair"][0], torch.tensor([1.0, 5, 9]))
    assert copy["step"] == 7 and copy["groups"] == [{"lr": 0.1, "params": [0, 1]}] and copy["pair"][1] == "x"
    assert staged_bytes(memo) == 12 * 4  # one storage for the tensor and its three views


def test_the_next_checkpoint_reuses_the_last_ones_copies():
    weight = torch.zeros(4, 4)
    saves = BackgroundSaves()
    saves.reset_staging()
    first = saves.stage({"w": weight})["w"]
    weight.add_(1)
    saves.reset_staging()  # after the first write was waited for
    second = saves.stage({"w": weight})["w"]
    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and torch.equal(second, weight)
    saves.reset_staging()
    assert saves.stage({"w": torch.ones(8)})["w"].untyped_storage().data_ptr() != first.untyped_storage().data_ptr()


def test_adapter_written_from_the_staged_copy_is_the_synchronous_save(tiny_model_dir, tmp_path):
    import transformers
    from peft import LoraConfig, get_peft_model

    from sft.train.trainer import checkpoint_tensors

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "sync")
    tensors = checkpoint_tensors(model)
    assert all("lora_" in k for k in tensors) and len(tensors) == 4 * model.config.num_hidden_layers
    model.save_pretrained(tmp_path / "async", state_dict=stage(tensors))
    sync, async_ = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("sync", "async"))
    assert sync.keys() == async_.keys() and all(torch.equal(sync[k], async_[k]) for k in sync)


def args(out):
    return SimpleNamespace(output_dir=str(out), process_index=0, should_save=True)


def test_a_failed_background_write_leaves_no_marker_and_raises_at_the_next_wait(tmp_path):
    callback = ck.AtomicCheckpoints(2, {"world_size": 1}, BackgroundSaves())
    good = tmp_path / "checkpoint-1"
    good.mkdir()
    saves = callback.saves
    saves.add("weights", lambda: (good / "model.safetensors").write_bytes(b"w" * 100))
    saves.start(str(good), lambda error: callback.complete(args(tmp_path), str(good), {}, None, error))
    assert saves.wait("test") >= 0 and ck.verify(str(good)) is None

    bad = tmp_path / "checkpoint-2"
    bad.mkdir()
    (bad / "trainer_state.json").write_text("{}")

    def full_disk():
        (bad / "model.safetensors").write_bytes(b"w" * 10)
        raise OSError(errno.ENOSPC, "No space left on device", str(bad / "model.safetensors"))

    saves.add("weights", full_disk)
    saves.start(str(bad), lambda error: callback.complete(args(tmp_path), str(bad), {}, None, error))
    with pytest.raises(OSError, match="No space left on device"):
        saves.wait("test")
    assert not os.path.exists(bad / ck.MARKER) and ck.latest_complete(str(tmp_path)) == str(good)
    assert saves.wait("again") == 0.0  # raised once; nothing in flight any more


def test_at_most_one_save_in_flight(tmp_path):
    import threading

    release, order = threading.Event(), []
    saves = BackgroundSaves()
    saves.add("slow", lambda: (release.wait(10), order.append("first")))
    saves.start(str(tmp_path), lambda error: order.append("complete"))
    assert saves.in_flight and order == []
    release.set()
    saves.wait("the next checkpoint")
    assert order == ["first", "complete"] and not saves.in_flight
