"""Which class a folder loads as, and what text-only training leaves alone (sft/model/architecture.py)."""
import transformers

from sft.model.architecture import auto_class, freeze_non_text, linear_names_outside_text, non_text_modules
from tests.helpers.families import tiny_config, tiny_model


def test_multimodal_checkpoint_is_its_own_architecture_with_the_vision_tower_frozen():
    config = tiny_config("qwen3_5", vocab_size=128)
    assert auto_class(config) is transformers.AutoModelForImageTextToText
    assert auto_class(tiny_config("qwen3_5_text", vocab_size=128)) is transformers.AutoModelForCausalLM
    model = tiny_model("qwen3_5", vocab_size=128)
    assert non_text_modules(model) == ["model.visual"]
    names = linear_names_outside_text(model)
    assert names and all(n.startswith("model.visual.") for n in names)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    assert freeze_non_text(model) == vision
    assert all(not p.requires_grad for p in model.model.visual.parameters())
    assert all(p.requires_grad for p in model.model.language_model.parameters())


def test_a_causal_lm_has_nothing_to_freeze():
    model = tiny_model("qwen3_5_text", vocab_size=128)
    assert non_text_modules(model) == [] and freeze_non_text(model) == 0
