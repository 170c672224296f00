"""Hybrid models (linear attention / state-space / convolution layers beside attention) through ``sft-train``."""
import math

from tests.helpers.families import tiny_family_dir
from tests.integration.app.test_train import train


def test_default_command_trains_qwen3_5_padding_free(toy_data, tmp_path, caplog):
    """The default command (padding-free rows) on a tiny Qwen3.5: transformers' reference gated delta rule, handed
    the collator's boundaries, raised ("can't keep packed sequences apart"); the layers now run per document."""
    caplog.set_level("INFO")
    trainer, _, losses = train(tiny_family_dir("qwen3_5_text"), toy_data, tmp_path / "out", "--max_steps", "2",
                               "--per_device_train_batch_size", "4", "--model_max_length", "128")
    assert type(trainer.data_collator).__name__ == "PaddingFreeCollator"
    assert losses and all(math.isfinite(x) for x in losses)
    assert "run once per document" in caplog.text and "Qwen3_5GatedDeltaNet" in caplog.text
