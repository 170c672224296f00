"""Test worker run under torchrun (2 processes, gloo): one experts module of a tiny model with LoRA, cut over the 2
ranks (sft.model.expert_parallel), against the whole module in every process: outputs, input gradients and expert
LoRA gradients (gathered) for random routing, and for routing that sends every token to rank 0's experts (rank 1
receives no row and must still join both exchanges' backward: no hang). Writes ``rank{N}.json`` into
``$SFT_TEST_REPORT_DIR``: the largest differences per family and case. Arguments: the model families."""
import json
import os
import sys

import torch
import torch.distributed as dist

from sft.distributed import expert_parallel
from sft.model.expert_parallel import experts_modules, shard_experts, whole_tensor
from sft.model.loading import apply_lora
from sft.model.spec import LoraSpec
from tests.helpers.families import tiny_model


def build(family):
    torch.manual_seed(0)
    model = apply_lora(tiny_model(family, vocab_size=128), None, False,
                       LoraSpec(train_embeddings="false", r=4, dropout=0.0))
    with torch.no_grad():  # lora_B non-zero, the same in every process
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(sum(n.encode())))
    return model


def main():
    dist.init_process_group("gloo")
    rank, ep, report = dist.get_rank(), expert_parallel.start(2), {}
    for family in sys.argv[1:]:
        report[family] = compare(family, rank, ep)
    with open(os.path.join(os.environ["SFT_TEST_REPORT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def compare(family, rank, ep):
    whole, part = build(family), build(family)
    cut = shard_experts(part, ep)
    (_, chain_w), (_, chain_p) = experts_modules(whole)[0], experts_modules(part)[0]
    names = {id(p): n for n, p in part.named_parameters()}
    grads_w = dict(whole.named_parameters())
    report = {}
    for case, high in (("random", 8), ("all_to_rank0", 4)):  # experts 0..3 are rank 0's: rank 1 receives no row
        g = torch.Generator().manual_seed(3)
        x = torch.randn(6, whole.config.hidden_size, generator=g, requires_grad=True)
        ids = torch.randint(0, high, (6, 2), generator=g)
        w = torch.rand(6, 2, generator=g)
        mine = slice(3 * rank, 3 * rank + 3)
        xs = x[mine].detach().requires_grad_()
        out_w, out_p = chain_w[0](x, ids, w), chain_p[0](xs, ids[mine], w[mine])
        out_w.pow(2).sum().backward()
        out_p.pow(2).sum().backward()
        worst = 0.0
        for p, layout, total in cut:
            if p.requires_grad and grads_w[names[id(p)]].grad is not None:
                mine_g = whole_tensor(p.grad if p.grad is not None else torch.zeros_like(p), layout, total, ep.group)
                worst = max(worst, float((mine_g - grads_w[names[id(p)]].grad).abs().max()))
        report[case] = {"out": float((out_p - out_w[mine]).abs().max()),
                        "x_grad": float((xs.grad - x.grad[mine]).abs().max()), "expert_grad": worst}
        whole.zero_grad(set_to_none=True)
        part.zero_grad(set_to_none=True)
    return report


if __name__ == "__main__":
    main()
