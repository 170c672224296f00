"""--packing in a training run: the trainer's packed rows give the unpacked loss, then train. The packing itself
(bins, rows, position ids, attention kept inside each conversation, conflicts) is checked in
tests/unit/test_packing.py."""
import torch

from sft.dataset import make_collator
from sft.packing import PackedCollator, split_row
from sft.training import build_trainer
from tests.helpers.data import TOY
from tests.unit.test_packing import train_args


def test_trainer_with_packing_matches_unpacked_loss(tiny_model_dir, toy_data, tmp_path):
    args = train_args(tiny_model_dir, toy_data, tmp_path / "p", "--packing", "True", "--model_max_length", "64",
                      "--per_device_train_batch_size", "2", "--max_steps", "2")
    trainer, tok, _ = build_trainer(*args)
    ds = trainer.train_dataset
    assert len(ds) < len(TOY) and sum(len(r["input_ids"]) for r in ds) == sum(
        len(c["input_ids"]) for r in ds for c in split_row(r))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    convs = [c for r in [ds[i] for i in range(len(ds))] for c in split_row(r)]
    model = trainer.model.eval()
    with torch.no_grad():
        packed = model(**PackedCollator()(list(ds))).loss  # every row at once: all conversations, no padding
        padded = make_collator(tok)(convs)
        unpacked = model(**padded, use_cache=False).loss
    assert padded["attention_mask"].sum() < padded["attention_mask"].numel()  # the unpacked batch has padding
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-5)
    model.train()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < x < 100 for x in losses)
