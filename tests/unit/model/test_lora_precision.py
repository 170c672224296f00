"""LoRA inputs kept in the autocast dtype (issue 30, item 2; sft.model.loading.keep_lora_inputs_in_autocast_dtype):
under bf16 autocast with LoRA dropout 0 (or in evaluation) the step makes fewer dtype-cast copies and gives bitwise the
same loss and gradients as peft's own casting; an active dropout, or a forward outside autocast, keeps peft's cast."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from sft.model.loading import apply_lora
from sft.model.spec import LoraSpec


class CountOps(TorchDispatchMode):
    """Counts aten calls by name (autocast's casts reach this mode as ``aten._to_copy``)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def lora_model(hooked: bool, dropout: float):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    model = apply_lora(LlamaForCausalLM(cfg).to(torch.bfloat16), None, False,
                       LoraSpec(r=8, alpha=16, dropout=dropout, train_embeddings="false"))
    with torch.no_grad():  # B starts at zero: give the adapters a path that changes the loss and A's gradients
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    if not hooked:  # peft's own behaviour: the input cast to fp32 in every LoRA layer
        for m in model.modules():
            if hasattr(m, "lora_A"):
                m._forward_pre_hooks.clear()
    return model


def step(model, ids, autocast: bool):
    ops = CountOps()
    torch.manual_seed(1)  # the same dropout draws
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), ops:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, ops.calls


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_under_bf16_autocast_bitwise_the_same_loss_and_gradients_fewer_casts_where_exact(dropout):
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(2))
    peft_loss, peft_grads, peft_ops = step(lora_model(False, dropout), ids, autocast=True)
    ours = lora_model(True, dropout)
    assert all(p.dtype == torch.float32 for n, p in ours.named_parameters() if "lora_" in n)  # master weights
    loss, grads, ops = step(ours, ids, autocast=True)
    assert torch.equal(loss, peft_loss)
    assert grads.keys() == peft_grads.keys() and len(grads) == 2 * 2 * 7  # A and B, 2 layers, 7 projections
    assert all(torch.equal(grads[n], peft_grads[n]) for n in grads)
    if dropout:  # bf16 dropout on CPU rounds its scale 1/(1-p) to bf16: the cast to fp32 stays
        assert ops["aten._to_copy"] == peft_ops["aten._to_copy"]
    else:  # two full-size copies per LoRA layer in forward (x to fp32, back to bf16) and their two in backward
        assert peft_ops["aten._to_copy"] - ops["aten._to_copy"] >= 3 * 14


def test_in_evaluation_the_dropout_is_inactive_and_the_cast_is_skipped():
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    counts = []
    for hooked in (False, True):
        model = lora_model(hooked, 0.05).eval()
        ops = CountOps()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), ops:
            counts.append((model(input_ids=ids, labels=ids).loss, ops.calls["aten._to_copy"]))
    (peft_loss, peft_casts), (loss, casts) = counts
    assert torch.equal(loss, peft_loss) and peft_casts - casts >= 14


def test_outside_autocast_peft_still_casts_the_input():
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    model = lora_model(True, 0.0)
    loss, grads, _ = step(model, ids, autocast=False)  # bf16 input, fp32 adapters: would raise without the cast
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert all(m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "lora_A"))
