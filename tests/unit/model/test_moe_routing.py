"""Mixture-of-experts routing (sft/model/routing.py, sft/train/routing_health.py) and the supervised-only LM head on
MoE models (sft/model/loss.py): tiny random models of transformers' own configs (tests/helpers/families.py),
vocabulary 128, fp32.

Tolerances: losses relative 1e-5; gradients and weights relative 1e-5 with an absolute floor of 1e-7 (the head and
the loss sum run in another order than over the whole logits; micro batches add up gradients in another order).
"""
import pytest
import torch

from sft.model.experts import experts_blocks, mark_zero3_leaf_blocks
from sft.model.loss import compute_supervised_loss, supports_supervised_head
from sft.model.routing import aux_free_routers, model_aux_coef, resolve_aux_coef, routers, weighted_aux
from sft.train.routing_health import RoutingCounter, routing_line
from tests.helpers.families import tiny_model

RTOL, ATOL, VOCAB = 1e-5, 1e-7, 128


def batch(seed: int = 1, rows: int = 2, length: int = 16):
    """Rows of ``length`` tokens, the last row padded by 3; supervised spans in the middle of each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 4:12] = ids[:, 4:12]
    mask = torch.ones_like(ids)
    mask[-1, length - 3:] = 0
    labels[-1, length - 3:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# model type -> (MoE layers, experts, score-correction bias, own aux coefficient)
SHAPES = {"qwen3_moe": (2, 8, False, 0.001), "mixtral": (2, 8, False, 0.001), "gpt_oss": (2, 8, False, 0.001),
          "deepseek_v3": (1, 8, True, None), "qwen3_next": (4, 8, False, 0.001),
          "qwen3_5_moe_text": (4, 8, False, 0.001), "kimi_linear": (3, 8, True, None), "jamba": (2, 4, False, 0.001)}
FAST_HEAD = {"qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_5_moe_text"}  # forwards read


@pytest.mark.parametrize("model_type", sorted(SHAPES))
def test_routers_found_by_structure(model_type):
    layers, experts, bias, coef = SHAPES[model_type]
    model = tiny_model(model_type, vocab_size=VOCAB)
    found = routers(model)
    assert [e for _, _, e in found] == [experts] * layers, [n for n, _, _ in found]
    assert aux_free_routers(model) == (layers if bias else 0)
    assert model_aux_coef(model) == coef
    assert supports_supervised_head(model) == (model_type in FAST_HEAD)
    # the blocks ZeRO-3 gathers whole: each router's parent, flagged as DeepSpeed leaf modules (sft.model.experts)
    blocks = experts_blocks(model)
    assert [n for n, _ in blocks] == [n.rpartition(".")[0] for n, _, _ in found]
    assert [b for _, b in mark_zero3_leaf_blocks(model)] == [b for _, b in blocks]
    assert [m for m in model.modules() if getattr(m, "_z3_leaf", False)] == [b for _, b in blocks]


def test_experts_and_routers_found_in_zero3_placeholders():
    """ZeRO-3 loads inside deepspeed.zero.Init: every parameter an empty placeholder, its shape in ``ds_shape``."""
    from sft.model.experts import lora_candidates

    model = tiny_model("deepseek_v3", vocab_size=VOCAB)
    want = [(t.path, t.kind) for t in lora_candidates(model, lambda m: isinstance(m, torch.nn.Linear))]
    for p in model.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    got = [(t.path, t.kind) for t in lora_candidates(model, lambda m: isinstance(m, torch.nn.Linear))]
    assert got == want and any(kind == "experts" for _, kind in got) and any(kind == "router" for _, kind in got)
    assert [e for _, _, e in routers(model)] == [8] and len(experts_blocks(model)) == 1


def test_aux_coefficient_defaults_and_refusals():
    from sft.errors import ConfigError

    moe, free = tiny_model("qwen3_moe", vocab_size=VOCAB), tiny_model("deepseek_v3", vocab_size=VOCAB)
    assert resolve_aux_coef(moe, None, router_trained=True) == 0.001  # full fine-tuning: the model's own
    assert resolve_aux_coef(moe, None, router_trained=False) == 0.0  # frozen router (LoRA)
    assert resolve_aux_coef(moe, 0.02, router_trained=False) == 0.02  # asked for
    assert resolve_aux_coef(free, None, router_trained=True) == 0.0
    with pytest.raises(ConfigError, match="score-correction bias"):
        resolve_aux_coef(free, 0.01, router_trained=True)
    assert free.model.layers[1].mlp.gate.e_score_correction_bias.requires_grad is False  # a buffer: never trained


@pytest.mark.parametrize("model_type", sorted(FAST_HEAD))
def test_supervised_head_equals_full_path_with_aux_loss(model_type):
    """The supervised-only head plus ``coef x aux`` (weighted_aux without num_items: the micro batch's own) equals the
    model's own loss with labels and output_router_logits=True, and so do all gradients, the router's included
    (DeepSeek-V3: no aux loss, the cross entropy alone)."""
    model = tiny_model(model_type, vocab_size=VOCAB).train()
    inputs, coef = batch(), model_aux_coef(model)
    kwargs = {"output_router_logits": True} if coef is not None else {}
    full = model(**inputs, **kwargs, use_cache=False).loss
    full_grads = grads_of(model, full)
    loss, out = compute_supervised_loss(model, inputs, None, model.get_output_embeddings(), return_outputs=True,
                                        **kwargs)
    ours = loss + coef * weighted_aux(out.aux_loss, inputs["labels"][:, 1:], None) if coef is not None else loss
    assert coef is None or out.aux_loss.item() > 0
    assert ours.item() == pytest.approx(full.item(), rel=RTOL)
    ours_grads = grads_of(model, ours)
    assert ours_grads.keys() == full_grads.keys() and f"{routers(model)[0][0]}.weight" in full_grads
    for name, g in full_grads.items():
        torch.testing.assert_close(ours_grads[name], g, rtol=RTOL, atol=ATOL, msg=name)


def test_weighted_aux_is_the_micro_batch_share_of_the_global_batch():
    labels = torch.tensor([[-100, 5, 6, -100], [7, -100, -100, -100]])  # 3 supervised targets
    assert weighted_aux(torch.tensor(2.0), labels, torch.tensor(12)).item() == pytest.approx(2.0 * 3 / 12)
    assert weighted_aux(torch.tensor(2.0), labels, None).item() == 2.0


def test_routing_counter_counts_every_top_k_choice():
    """Counts per expert equal the top-k of the model's own recorded router logits; the window resets on take()."""
    model = tiny_model("qwen3_moe", vocab_size=VOCAB).train()
    counter = RoutingCounter(model)
    inputs = batch(rows=3)
    out = model(input_ids=inputs["input_ids"], output_router_logits=True, use_cache=False)
    out = model(input_ids=inputs["input_ids"], output_router_logits=True, use_cache=False)  # two micro batches
    figures = counter.take()
    expected = []
    for logits in out.router_logits:
        counts = torch.bincount(logits.topk(2, dim=-1).indices.reshape(-1), minlength=8).float() * 2
        expected.append((counts.max() / counts.mean()).item())
        idle = [e for e in range(8) if counts[e] == 0]
        assert idle == figures["layers"][len(expected) - 1][2]
    assert [r for _, r, _ in figures["layers"]] == pytest.approx(expected)
    assert figures["moe_max_load"] == pytest.approx(max(expected))
    assert "routing at step 3:" in routing_line(3, figures) and counter.take() == {}
    model.eval()
    model(input_ids=inputs["input_ids"], use_cache=False)
    assert counter.take() == {}  # evaluation forwards are not counted
    counter.remove()


def train_one_step(trainer_cls, micro_batch: int, accumulation: int, coef: float, tmp_path, **trainer_kwargs):
    """One SGD step of full fine-tuning on 4 identical rows (so that the aux loss of 4 rows together equals that of
    each: the rows are distributed the same), as ``micro_batch`` x ``accumulation``. Returns the weights after."""
    import transformers

    model = tiny_model("qwen3_moe", vocab_size=VOCAB)
    model.router_aux_loss_coef = coef  # transformers' own addition (the plain Trainer); sft's switches it off
    model.config.output_router_logits = trainer_cls is transformers.Trainer
    row = {k: v[0] for k, v in batch(rows=1).items()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
        max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", seed=0, disable_tqdm=True, dataloader_drop_last=True)
    trainer = trainer_cls(model=model, args=args, train_dataset=[row] * 4, **trainer_kwargs)
    trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


GATE = "model.layers.0.mlp.gate.weight"


def test_aux_loss_update_same_at_gradient_accumulation_1_and_4(tmp_path):
    """sft's Trainer: the same update from 1 micro batch of 4 rows and 4 micro batches of 1 row, the aux loss on
    (coefficient 1, so that its share of the update is large), through the full path and the supervised head."""
    from sft.train.trainer import Trainer

    ours = [train_one_step(Trainer, mb, ga, 1.0, tmp_path, moe_aux_loss_coef=1.0, supervised_head=head)
            for mb, ga, head in ((4, 1, True), (1, 4, False))]  # the supervised head at 1, the full path at 4
    for name, w in ours[0].items():
        torch.testing.assert_close(ours[1][name], w, rtol=RTOL, atol=ATOL, msg=name)


def test_transformers_own_aux_loss_grows_with_gradient_accumulation(tmp_path):
    """What the test above guards against: transformers' Trainer with the model's own ``coef x aux`` per micro batch
    moves the router differently at 4 micro batches (the aux loss weighs 4 times more), and at 1 as sft does at 4."""
    import transformers

    from sft.train.trainer import Trainer

    theirs = [train_one_step(transformers.Trainer, mb, ga, 1.0, tmp_path) for mb, ga in ((4, 1), (1, 4))]
    assert not torch.allclose(theirs[0][GATE], theirs[1][GATE], rtol=1e-3, atol=1e-5)
    ours = train_one_step(Trainer, 1, 4, 1.0, tmp_path, moe_aux_loss_coef=1.0, supervised_head=True)
    torch.testing.assert_close(theirs[0][GATE], ours[GATE], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("wrap", ["peft_all_linear", "experts_4bit"])
def test_routers_found_through_lora_and_4bit_experts(wrap):
    """peft's LoRA with 'all-linear' (ParamWrapper on the 3-D experts and the router) and bitsandbytes' 4-bit
    parametrization of the expert stacks leave the same routers found, and the counts still come."""
    model = tiny_model("qwen3_moe", vocab_size=VOCAB)
    if wrap == "peft_all_linear":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, lora_dropout=0.0, target_modules="all-linear"))
    else:
        from bitsandbytes.nn.parametrize import replace_parameter_4bit

        for layer in model.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                replace_parameter_4bit(layer.mlp.experts, name, quant_type="nf4")
    assert [(n.split("layers.")[-1], e) for n, _, e in routers(model)] == [("0.mlp.gate", 8), ("1.mlp.gate", 8)]
    counter = RoutingCounter(model)
    model.train()
    model(input_ids=batch()["input_ids"], use_cache=False)
    assert len(counter.take()["layers"]) == 2
    counter.remove()
