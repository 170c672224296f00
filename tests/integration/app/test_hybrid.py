"""Hybrid models (linear attention / state-space / convolution layers beside attention) through ``sft-train``."""
import json
import math
import os

import pytest
import torch

from tests.helpers.families import tiny_family_dir
from tests.integration.app.test_train import logits, train


@pytest.mark.parametrize("family,kind,steps", [
    ("qwen3_5_text", "Qwen3_5GatedDeltaNet", 2), ("qwen3_next", "Qwen3NextGatedDeltaNet", 1),
    ("kimi_linear", "KimiLinearDeltaAttention", 1), ("lfm2", "Lfm2ShortConv", 1),
    ("nemotron_h", "NemotronHMamba2Mixer", 1), ("jamba", "JambaMambaMixer", 1)])
def test_default_command_trains_hybrids_padding_free(family, kind, steps, toy_data, tmp_path, caplog):
    """The default command (padding-free rows of 4 conversations) on tiny models of the issue's hybrid families: the
    token mixers run per document (their exactness, family by family: tests/unit/model/test_token_mixers.py).
    Before, Qwen3.5's and Qwen3-Next's reference gated delta rule, handed the collator's boundaries, raised ("can't
    keep packed sequences apart"), and the others mixed the documents of a row silently."""
    caplog.set_level("INFO")
    trainer, _, losses = train(tiny_family_dir(family), toy_data, tmp_path / "out", "--max_steps", str(steps),
                               "--per_device_train_batch_size", "4", "--model_max_length", "128")
    assert type(trainer.data_collator).__name__ == "PaddingFreeCollator"
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    assert "run once per document" in caplog.text and kind in caplog.text


def _weights(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {k: v.detach().clone() for k, v in base.state_dict().items()}


@pytest.mark.parametrize("family,lora", [("qwen3_5", False), ("qwen3_5_moe", True)])
def test_multimodal_checkpoint_trained_on_text_saves_in_its_original_form(family, lora, toy_data, tmp_path):
    """A Qwen3.5(-MoE) checkpoint as released (``*ForConditionalGeneration`` with a vision tower), fine-tuned on
    text: the language model changes, the vision tower does not, and the saved folder (merged for LoRA) loads back as
    the original architecture with the original key names and the trained model's logits."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    src = tiny_family_dir(family)
    original = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    before = _weights(original)
    extra = ["--use_lora", "True", "--lora_r", "4", "--learning_rate", "1e-2"] if lora else ["--learning_rate", "1e-3"]
    out = tmp_path / "out"
    trainer, tok, losses = train(src, toy_data, out, "--max_steps", "2", "--per_device_train_batch_size", "4",
                                 "--model_max_length", "128", *extra)
    model = trainer.model.merge_and_unload() if lora else trainer.model
    after = _weights(model)
    assert after.keys() == before.keys()
    vision = [k for k in before if ".visual." in k]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in before if ".language_model." in k)
    saved = out
    if lora:  # the merged folder, as sft-merge writes it
        from sft.model.export import merge_adapter
        saved = tmp_path / "merged"
        merge_adapter(str(out), str(saved), src)
    with open(saved / "config.json") as f:
        assert json.load(f)["architectures"] == list(original.config.architectures)
    names = []
    for folder in (src, saved):  # the key names on disk (transformers writes experts back in the checkpoint's form)
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            names.append(set(f.keys()))
    assert names[0] == names[1]
    reloaded = AutoModelForImageTextToText.from_pretrained(saved, dtype=torch.float32)
    torch.testing.assert_close(logits(reloaded, tok), logits(model, tok), rtol=1e-5, atol=1e-5)
