"""The expert rule (sft.model.experts) on families whose 3-D experts transformers runs with its own ``bmm`` or loop,
outside ``use_experts_implementation`` (Llama 4, LongCat-Flash, JetMoE: no ``is_transposed``): found by the router
beside them, adapted by the default LoRA with the router frozen, stored 4-bit under Q-LoRA, counted at top_k / E;
a 3-D parameter with no router beside it is not taken for experts."""
import pytest
import torch

from sft.model.experts import experts_modules, four_bit_values, quantize_experts
from sft.model.loading import apply_lora
from sft.model.routing import routers
from sft.model.spec import LoraSpec
from sft.train.counting import census
from tests.helpers.families import MOE_OWN_LOOP, tiny_model

IDS = torch.tensor([[5, 17, 99, 3, 42, 8, 77, 1]])


def _three_d(model):
    convs = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return {f"{mn}.{n}" for mn, m in model.named_modules() if not isinstance(m, convs)
            for n, p in m.named_parameters(recurse=False) if p.ndim == 3}


@pytest.mark.parametrize("family", MOE_OWN_LOOP)
def test_experts_beside_a_router_are_found_adapted_quantized_and_counted(family):
    model = tiny_model(family, vocab_size=128)
    found = experts_modules(model)
    assert not any(hasattr(m, "is_transposed") for _, m, _ in found)  # outside transformers' experts layout
    assert {f"{path}.{n}" for path, m, _ in found for n, p in m.named_parameters(recurse=False)
            if p.ndim == 3} == _three_d(model) != set()  # every 3-D parameter of the family is an expert stack
    assert len(census(model).experts) == len(found)  # FLOPs count them at top_k / E (sft.train.counting)
    lora = apply_lora(model, None, False, LoraSpec(r=4, train_embeddings="false"))  # the defaults (dropout 0.05)
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    per_expert = [n for n in trainable if any(f"{path}.lora_" in n.replace(".base_layer", "") for path, _, _ in found)]
    assert len(per_expert) == 2 * sum(sum(p.ndim == 3 for p in m.parameters(recurse=False)) for _, m, _ in found)
    assert not any("router" in n or "classifier" in n for n in trainable)  # the router stays frozen
    out = lora(input_ids=IDS, labels=IDS)
    out.loss.backward()
    assert all(p.grad is not None for n, p in lora.named_parameters() if n in per_expert)
    q = tiny_model(family, vocab_size=128)
    values = sum(p.numel() for _, m, _ in experts_modules(q) for p in m.parameters(recurse=False) if p.ndim == 3)
    assert quantize_experts(q) == values and four_bit_values(q)[0] == values


def test_a_three_d_parameter_without_a_router_beside_it_is_no_expert():
    class Probe(torch.nn.Module):  # SigLIP's attention-pooling probe [1, 1, H], a learned query [4, 8, 8]
        def __init__(self):
            super().__init__()
            self.probe = torch.nn.Parameter(torch.zeros(1, 1, 8))
            self.queries = torch.nn.Parameter(torch.zeros(4, 8, 8))
            self.proj = torch.nn.Linear(8, 8)

    block = torch.nn.Sequential(Probe(), torch.nn.Linear(8, 8))
    assert experts_modules(block) == [] and routers(block) == []
