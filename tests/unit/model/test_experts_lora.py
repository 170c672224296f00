"""LoRA on mixture-of-experts models (sft.model.experts, sft.model.expert_lora): the target rule, equality with peft's
ParamWrapper (the definition, at dropout 0), no expert-stack copy per forward, peft's saved format, merge."""
import logging

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import ParamWrapper as PeftParamWrapper

from sft.compat.peft import without_gptqmodel, without_v4_moe_conversion
from sft.errors import SFTError
from sft.model.expert_lora import ExpertLoraWrapper
from sft.model.experts import is_experts_module
from sft.model.loading import apply_lora
from sft.model.spec import LoraSpec
from tests.helpers.families import MOE, tiny_model

# families whose shared experts / dense MLPs carry names (gate_proj, up_proj, down_proj) that peft 0.21.2 rewrites
# into expert parameters when it loads an adapter of these model types (see sft.compat.peft.without_v4_moe_conversion)
PEFT_REWRITES = ("qwen3_next", "deepseek_v3")
IDS = torch.tensor([[5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 11, 90]])


def lora(model, **kw):
    kw.setdefault("r", 4)
    return apply_lora(model, None, False, LoraSpec(train_embeddings="false", **kw))


def experts_of(model):
    return [(n, m) for n, m in model.named_modules() if is_experts_module(m)]


def randomize_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("family", MOE)
def test_default_rule_adapts_experts_shared_and_attention_not_the_router(family, caplog):
    base = tiny_model(family, vocab_size=128)
    shapes = {n: [(p, tuple(getattr(m, p).shape)) for p in ("gate_up_proj", "up_proj", "down_proj") if hasattr(m, p)]
              for n, m in experts_of(base)}
    with caplog.at_level(logging.INFO, logger="sft.model.loading"):
        model = lora(base)  # the default dropout (0.05): peft alone refuses it on experts
    wrappers = [m for m in model.modules() if isinstance(m, ExpertLoraWrapper)]
    assert len(wrappers) == sum(len(v) for v in shapes.values()) > 0
    assert all(isinstance(w.lora_dropout["default"], torch.nn.Dropout) for w in wrappers)
    expected = sum(4 * s[0] * (s[1] + s[2]) for v in shapes.values() for _, s in v)  # r·E·(in+out) per tensor
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("LoRA r=4"))
    assert f"experts down_proj,{'gate_up_proj' if family != 'nemotron_h' else 'up_proj'} {expected:,}" in line
    assert "router frozen" in line
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(".gate." in n or ".router." in n or "shared_expert_gate" in n for n in trainable)
    if family in ("qwen3_5_moe_text", "qwen3_next", "deepseek_v3"):
        assert "shared " in line and any("shared_expert" in n and "lora_A" in n for n in trainable)
    routed = lora(tiny_model(family, vocab_size=128), router=True, dropout=0.0)
    assert any((".gate." in n or ".router." in n) and "lora_" in n for n, p in routed.named_parameters()
               if p.requires_grad)


@pytest.mark.parametrize("family", MOE)
def test_equals_peft_param_wrapper(family):
    ours = lora(tiny_model(family, vocab_size=128), dropout=0.0, target_modules=("gate_up_proj", "down_proj"))
    randomize_b(ours)
    cfg = ours.peft_config["default"]  # "down_proj" also names the shared experts' linear layers
    with without_v4_moe_conversion(), without_gptqmodel():
        ref = get_peft_model(tiny_model(family, vocab_size=128), LoraConfig(
            r=4, lora_alpha=16, target_parameters=list(cfg.target_parameters),
            target_modules=sorted(cfg.target_modules or [])))
    assert not any(isinstance(m, ExpertLoraWrapper) for m in ref.modules())
    ref.load_state_dict(ours.state_dict())
    out = [m(input_ids=IDS, labels=IDS) for m in (ours, ref)]
    torch.testing.assert_close(out[0].logits, out[1].logits, rtol=1e-5, atol=1e-5)
    for o in out:
        o.loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (ours, ref)]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-5, msg=n)


class LargestTensor(torch.overrides.TorchFunctionMode):
    """Records the largest new tensor (numel) any torch function returns inside the block: views of ``model``'s
    parameters (a transpose of the expert stack) are not new."""

    def __init__(self, model):
        super().__init__()
        self.largest = 0
        self.own = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.own:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_expert_stack_copy_per_forward():
    # 64 experts of 64 x 256 (2 x 1 M numbers per stack) against 6 tokens: any stack-sized tensor is a copy of W
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_hidden_layers=1, num_experts=64, num_experts_per_tok=2, moe_intermediate_size=128)
    stack = 64 * 256 * 64
    seen = {}
    for name, build in (("ours", lambda m: lora(m, dropout=0.0, target_modules=("gate_up_proj", "down_proj"))),
                        ("peft", lambda m: get_peft_model(m, LoraConfig(  # peft's own ParamWrapper
                            r=4, target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                            target_modules=[])))):
        with without_v4_moe_conversion(), without_gptqmodel():
            model = build(AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg)))
        with LargestTensor(model) as probe:
            model(input_ids=IDS[:, :6])
        seen[name] = probe.largest
    assert seen["peft"] >= stack  # the probe sees peft's W + s·B·A
    assert seen["ours"] < stack // 8, seen


@pytest.mark.parametrize("family", MOE)
def test_adapter_saves_in_peft_format_loads_and_merges(family, tmp_path):
    ours = lora(tiny_model(family, vocab_size=128))
    randomize_b(ours)
    ours.eval()
    with torch.no_grad():
        want = ours(input_ids=IDS).logits
    ours.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert any(k.endswith("mlp.experts.lora_A.weight") for k in keys)
    assert any(k.endswith("mlp.experts.base_layer.lora_B.weight") for k in keys)
    import contextlib

    ctx = without_v4_moe_conversion() if family in PEFT_REWRITES else contextlib.nullcontext()
    with ctx, without_gptqmodel():  # plain peft, its own ParamWrapper
        loaded = PeftModel.from_pretrained(tiny_model(family, vocab_size=128), tmp_path)
    assert any(type(m) is PeftParamWrapper for m in loaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, want, rtol=1e-5, atol=1e-5)
        merged = loaded.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=IDS).logits, want, rtol=1e-4, atol=1e-5)
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_unknown_and_router_names_are_refused_naming_what_exists():
    with pytest.raises(SFTError) as e:
        lora(tiny_model("qwen3_moe", vocab_size=128), target_modules=("w9",))
    assert "linear modules of this model: k_proj, o_proj, q_proj, v_proj" in str(e.value)
    assert "expert parameters: down_proj, gate_up_proj" in str(e.value)
    with pytest.raises(SFTError, match="--lora_router True"):
        lora(tiny_model("qwen3_moe", vocab_size=128), target_modules=("q_proj", "gate"))


def test_qlora_stores_experts_in_nf4_and_adapts_them_as_on_the_dequantized_base():
    from sft.model.experts import four_bit_values, quantize_experts

    shape = dict(hidden_size=64, moe_intermediate_size=64, head_dim=32)
    model = tiny_model("qwen3_moe", vocab_size=128, **shape)
    values = sum(getattr(m, p).numel() for _, m in experts_of(model) for p in ("gate_up_proj", "down_proj"))
    assert quantize_experts(model) == values
    packed = [m.parametrizations[p].original for _, m in experts_of(model) for p in ("gate_up_proj", "down_proj")]
    assert all(t.dtype == torch.uint8 for t in packed)
    four, total = four_bit_values(model)
    assert four == values
    assert total == sum(p.numel() for p in tiny_model("qwen3_moe", vocab_size=128, **shape).parameters())
    nf4_bytes = sum(t.numel() for t in packed) + sum(  # packed values + fp32 absmax per 64 values
        m.parametrizations[p][0].quant_state.absmax.numel() * 4 for _, m in experts_of(model)
        for p in ("gate_up_proj", "down_proj"))
    assert nf4_bytes <= 0.3 * four * 2  # against the bf16 bytes of the same experts
    ref = tiny_model("qwen3_moe", vocab_size=128, **shape)
    with torch.no_grad():  # the reference base: the dequantized values, as 16-bit parameters
        for (_, q), (_, r) in zip(experts_of(model), experts_of(ref)):
            for p in ("gate_up_proj", "down_proj"):
                getattr(r, p).copy_(getattr(q, p))
    ours = lora(model, dropout=0.0, target_modules=("gate_up_proj", "down_proj"))
    randomize_b(ours)
    with without_v4_moe_conversion(), without_gptqmodel():
        theirs = get_peft_model(ref, LoraConfig(r=4, lora_alpha=16, target_modules=[],
                                                target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    theirs.load_state_dict({k: v for k, v in ours.state_dict().items() if "lora_" in k}, strict=False)
    out = [m(input_ids=IDS, labels=IDS) for m in (ours, theirs)]
    torch.testing.assert_close(out[0].logits, out[1].logits, rtol=1e-5, atol=1e-5)
    out[0].loss.backward()
    assert all(p.grad is not None for n, p in ours.named_parameters() if "lora_" in n)
