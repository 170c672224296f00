"""Memory planned before step 1 (issue 30, item 7): padding-free micro batches under a token budget with the largest
first (sft.train.trainer.TokenBudgetBatchSampler; through the Trainer's own data loader in
tests/integration/data/test_packing.py), the planned peak and the
gradient checkpointing decision or refusal (sft.train.memory_plan), the flag rules, and the process group bound to its
CUDA device (a stand-in for torch.distributed: no GPU here)."""
import logging
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sft.errors import ConfigError, SFTError
from sft.train.memory_plan import (
    GIB,
    ParallelShape,
    activation_bytes_per_token,
    choose_checkpointing,
    fitting_tokens,
    plan,
)
from sft.train.trainer import TokenBudgetBatchSampler
from tests.unit.data.test_packing import train_args

LENGTHS = [500, 30, 700, 120, 64, 900, 10, 333, 250, 800, 45, 600, 77, 410, 95, 1000, 5, 260]


def test_micro_batches_keep_both_limits_and_every_sample_once():
    s = TokenBudgetBatchSampler(LENGTHS, micro_batch=4, max_tokens=1024, seed=3)
    batches = list(s)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    assert all(len(b) <= 4 and sum(LENGTHS[i] for i in b) <= 1024 for b in batches)
    assert len(s) == len(batches) > len(LENGTHS) // 4  # the budget split some micro batches of 4
    assert sum(LENGTHS[i] for i in batches[0]) == s.largest_tokens == max(sum(LENGTHS[i] for i in b) for b in batches)


def test_order_is_a_function_of_seed_and_epoch_with_the_largest_first_in_every_epoch():
    a, b = TokenBudgetBatchSampler(LENGTHS, 3, 1200, seed=7), TokenBudgetBatchSampler(LENGTHS, 3, 1200, seed=7)
    orders = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        first, again = list(a), list(b)
        assert first == again and len(first) == len(a)  # same count every epoch: the Trainer sizes epochs once
        assert sum(LENGTHS[i] for i in first[0]) == a.largest_tokens
        orders.append(first)
    assert orders[1] != orders[2]
    assert {tuple(x) for x in orders[0]} == {tuple(x) for x in orders[1]}  # composition fixed, order reshuffled


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_are_dealt_the_one_process_order_in_turn(world):
    """Micro batch i of the one-process order goes to rank i % W (accelerate's dealing, which sft.train.world_size
    relies on), padded with the epoch's first micro batches to a multiple of W."""
    one = list(TokenBudgetBatchSampler(LENGTHS, 2, 1000, seed=1))
    ranks = [list(TokenBudgetBatchSampler(LENGTHS, 2, 1000, seed=1, world_size=world, rank=r)) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) == len(TokenBudgetBatchSampler(LENGTHS, 2, 1000, 1,
                                                                                                  world, 0))
    dealt = [ranks[i % world][i // world] for i in range(world * len(ranks[0]))]
    assert dealt[:len(one)] == one and dealt[len(one):] == one[:len(dealt) - len(one)]


def test_a_sample_over_the_budget_is_refused():
    with pytest.raises(ValueError, match="sample 5 has 900 tokens, more than the token budget 800"):
        TokenBudgetBatchSampler([10, 20, 30, 40, 50, 900], 2, 800, seed=0)


@pytest.mark.parametrize("extra,msg", [
    (["--max_tokens_per_micro_batch", "100", "--model_max_length", "128"], "below --model_max_length 128"),
    (["--max_tokens_per_micro_batch", "4096", "--packing", "True"], "with --packing True"),
    (["--max_tokens_per_micro_batch", "9000", "--padding_free", "False"], "with --padding_free False"),
    (["--max_tokens_per_micro_batch", "9000", "--group_by_length", "True"], "with --group_by_length True"),
    (["--max_tokens_per_micro_batch", "9000", "--lazy_preprocess", "True", "--long_conversations", "truncate"],
     "with --lazy_preprocess True"),
])
def test_token_budget_rules(tiny_model_dir, toy_data, tmp_path, extra, msg):
    with pytest.raises(ConfigError, match=msg):
        train_args(tiny_model_dir, toy_data, tmp_path / "c", *extra)


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=16,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config)


def test_activations_per_token_follow_the_model_shape_and_checkpointing(llama):
    c = llama.config
    full, ckpt = activation_bytes_per_token(c, 2, False), activation_bytes_per_token(c, 2, True)
    assert ckpt < full / 2
    assert activation_bytes_per_token(c, 4, False) > full  # fp32 activations
    c2 = LlamaConfig(**{**c.to_dict(), "num_hidden_layers": 20})
    assert activation_bytes_per_token(c2, 2, False) - full == 4 * (full - activation_bytes_per_token(
        LlamaConfig(**{**c.to_dict(), "num_hidden_layers": 15}), 2, False))  # linear in the layer count
    assert activation_bytes_per_token(c, 2, False, lora_in_bytes=4, lora_dropout=True) > full


def test_plan_counts_gradients_and_adam_state_and_shards_them(llama):
    n = sum(p.numel() for p in llama.parameters())
    p1 = plan(llama, tokens=1000, checkpointing=False, optim="adamw_torch", held_available=(GIB, 8 * GIB, "test"))
    assert (p1.gradients, p1.optimizer, p1.weights) == (4 * n, 8 * n, GIB)  # AdamW's two moments
    assert p1.optimizer_step == 4 * n  # the step's sqrt(exp_avg_sq) temporaries, once activations are freed
    assert p1.activations == 1000 * p1.per_token and p1.peak == GIB + 12 * n + p1.activations + p1.head
    tiny = plan(llama, tokens=1, checkpointing=True, optim="adamw_torch", held_available=(GIB, 8 * GIB, "test"))
    assert tiny.activations + tiny.head < tiny.optimizer_step and tiny.peak == GIB + 16 * n  # the step is the peak
    p2 = plan(llama, tokens=1000, checkpointing=False, optim="adamw_torch",
              parallel=ParallelShape(world_size=4, zero_stage=2, deepspeed=True), held_available=(GIB, 8 * GIB, "test"))
    assert p2.gradients == n and p2.optimizer == (4 + 8) * n // 4  # fp32 master and moments, partitioned
    ddp = plan(llama, tokens=1000, checkpointing=False, optim="adamw_torch", parallel=ParallelShape(world_size=2),
               held_available=(GIB, 8 * GIB, "test"))
    assert ddp.gradients == 8 * n and ddp.optimizer == 8 * n  # DDP's buckets hold the gradients again
    fsdp = plan(llama, tokens=1000, checkpointing=False, optim="adamw_torch",
                parallel=ParallelShape(world_size=2, fsdp=True), held_available=(GIB, 8 * GIB, "test"))
    assert (fsdp.gradients, fsdp.optimizer, fsdp.optimizer_step) == (2 * n, 4 * n, 2 * n)  # sharded over 2
    assert plan(llama, tokens=1000, checkpointing=False, optim="adamw_bnb_8bit",
                held_available=(GIB, 8 * GIB, "test")).optimizer == 2 * n
    # --save_async on CPU: the host copy of a checkpoint (every weight and the optimizer state; FSDP: this rank's)
    staged = plan(llama, tokens=1000, checkpointing=False, optim="adamw_torch", held_available=(GIB, 8 * GIB, "test"),
                  staged_checkpoint=True)
    assert staged.staged == 4 * n + 8 * n and staged.peak == p1.peak + 12 * n and "+ staged checkpoint" in staged.line()
    assert plan(llama, tokens=1000, checkpointing=False, optim="adamw_torch", parallel=ParallelShape(world_size=2,
                fsdp=True), held_available=(GIB, 8 * GIB, "test"), staged_checkpoint=True).staged == 2 * n + 4 * n
    assert plan(llama, tokens=1000, checkpointing=False, optim="adamw_torch", device=torch.device("cuda"),
                held_available=(GIB, 8 * GIB, "test"), staged_checkpoint=True).staged == 0  # pinned host memory


def _planner(llama, available):
    return lambda on, tokens=None: plan(llama, tokens=tokens or 20_000, checkpointing=on, optim="adamw_torch",
                                        held_available=(GIB // 4, available, "test memory"))


def test_unset_checkpointing_is_turned_on_only_when_needed(llama, caplog):
    big = _planner(llama, 64 * GIB)
    assert choose_checkpointing(big, None)[0] is False
    full, ckpt = _planner(llama, 0)(False), _planner(llama, 0)(True)
    between = int((full.peak + ckpt.peak) / 2 / 0.9)  # fits with checkpointing only
    with caplog.at_level(logging.INFO, logger="sft"):
        on, p, budget = choose_checkpointing(_planner(llama, between), None)
    assert on is True and p.checkpointing and p.fits and budget is None
    assert any("gradient checkpointing on" in r.getMessage() for r in caplog.records)
    assert choose_checkpointing(_planner(llama, between), True)[0] is True


def test_a_plan_that_cannot_fit_is_refused_with_the_fixes(llama, caplog):
    full = _planner(llama, 0)(False)
    tight = int((full.peak - full.activations / 2) / 0.9)  # half the activations would fit, without checkpointing
    with pytest.raises(SFTError) as e:
        choose_checkpointing(_planner(llama, tight), False, fixes_extra=("--use_lora True",))
    text = str(e.value)
    assert text.startswith("this run does not fit in memory, refused before step 1: memory plan:")
    assert "planned peak" in text and "test memory" in text
    tokens = fitting_tokens(_planner(llama, tight)(False))
    assert 0 < tokens < 20_000 and f"--max_tokens_per_micro_batch {tokens} " in text
    assert "--gradient_checkpointing True" in text and "--use_lora True" in text and "--memory_check warn" in text
    assert plan(llama, tokens=tokens, checkpointing=False, optim="adamw_torch",
                held_available=(GIB // 4, tight, "test memory")).fits  # the budget it names fits
    with caplog.at_level(logging.WARNING, logger="sft"):
        assert choose_checkpointing(_planner(llama, tight), False, mode="warn")[0] is False
    assert any("--max_tokens_per_micro_batch" in r.getMessage() for r in caplog.records)


def test_an_unset_budget_is_lowered_before_checkpointing_and_instead_of_a_refusal(llama, caplog):
    ckpt = _planner(llama, 0)(True)
    tight = int((ckpt.peak - ckpt.activations / 2) / 0.9)  # half the activations fit, with checkpointing
    f_off, f_on = fitting_tokens(_planner(llama, tight)(False)), fitting_tokens(_planner(llama, tight)(True))
    assert 0 < f_off < f_on < 20_000
    with caplog.at_level(logging.INFO, logger="sft"):  # smaller micro batches, no recomputation
        on, p, budget = choose_checkpointing(_planner(llama, tight), None, budget_floor=f_off)
    assert (on, budget, p.tokens) == (False, f_off, f_off) and p.fits
    assert any(f"token budget {f_off} per micro batch (unset --max_tokens_per_micro_batch" in r.getMessage()
               for r in caplog.records)
    on, p, budget = choose_checkpointing(_planner(llama, tight), None, budget_floor=f_off + 1)  # then checkpointing
    assert (on, budget) == (True, f_on) and p.fits and p.checkpointing
    with pytest.raises(SFTError, match=f"--max_tokens_per_micro_batch {f_on} "):  # below the floor: refused
        choose_checkpointing(_planner(llama, tight), None, budget_floor=f_on + 1)
    with pytest.raises(SFTError):  # a budget the user set is never lowered (no floor given)
        choose_checkpointing(_planner(llama, tight), None)


def test_the_process_group_is_bound_to_the_local_cuda_device(monkeypatch):
    import torch.distributed as dist

    from sft.distributed import process_group

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k, v in (("RANK", "1"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(k, v)
    assert process_group.init_process_group(None, 60) is True
    assert calls[0] == ("set_device", torch.device("cuda", 1))
    kw = calls[1][1]
    assert kw["backend"] == "nccl" and kw["device_id"] == torch.device("cuda", 1)
    assert kw["timeout"].total_seconds() == 60
    assert os.environ["LOCAL_RANK"] == "1"


@pytest.mark.parametrize("device,on_device,expected", [
    (torch.device("cuda", 1), True, {"": 1}), (torch.device("cuda", 1), False, None),
    (torch.device("cpu"), True, None)])
def test_weights_load_straight_onto_the_gpu_unless_a_sharder_places_them(tiny_model_dir, qwen_tok, monkeypatch,
                                                                         device, on_device, expected):
    """On CUDA (no DeepSpeed or FSDP) from_pretrained gets device_map = this process's GPU and the training dtype:
    no host copy first (issue 30, item 3). A stand-in for from_pretrained: no GPU here."""
    import transformers

    from sft.model.loading import load_model
    from sft.model.spec import LoadSpec

    seen = {}

    def fake(path, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake)
    with pytest.raises(Exception):
        load_model(tiny_model_dir, qwen_tok, False, LoadSpec(dtype=torch.bfloat16, load_on_device=on_device), device)
    assert seen["dtype"] == torch.bfloat16 and seen.get("device_map") == expected


def test_the_probe_measures_what_autograd_keeps_and_plans_with_it(llama):
    """measure_saved_bytes: one forward pass under saved_tensors_hooks; per token it is within 2x of the shape-based
    count for this fp32 Llama, grows with LoRA dropout, leaves the RNG alone, and steps aside under checkpointing."""
    from peft import LoraConfig, get_peft_model

    from sft.train.memory_plan import measure_saved_bytes

    state = torch.random.get_rng_state()
    total, layer = measure_saved_bytes(llama, tokens=64)
    assert torch.equal(state, torch.random.get_rng_state())
    shaped = activation_bytes_per_token(llama.config, 4, False)
    assert shaped / 2 < total < 2 * shaped and layer == total / llama.config.num_hidden_layers
    p = plan(llama, tokens=100, checkpointing=False, optim="sgd", measured=(total, layer),
             held_available=(0, GIB, "test"))
    from sft.train.memory_plan import BACKWARD_FACTOR

    assert p.per_token == int(total * BACKWARD_FACTOR) and p.activations == 100 * p.per_token
    lora = get_peft_model(LlamaForCausalLM(llama.config),
                          LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear"))
    assert measure_saved_bytes(lora, tokens=64)[0] > total
    llama.activation_checkpointing_enable()
    try:
        assert measure_saved_bytes(llama, tokens=64) is None
    finally:
        llama.activation_checkpointing_disable()


def test_sequence_parallel_ranks_hold_the_activations_of_their_share_of_the_tokens(llama):
    """ParallelShape(sequence_parallel=N): each of the N ranks holds ceil(tokens / N) tokens' activations and LM head;
    weights, gradients and optimizer state are as without it; the most tokens that fit grow N-fold."""
    held = (GIB // 4, 8 * GIB, "test")
    one = plan(llama, tokens=1001, checkpointing=False, optim="adamw_torch", supervised_head=False,
               parallel=ParallelShape(world_size=4), held_available=held)
    four = plan(llama, tokens=1001, checkpointing=False, optim="adamw_torch", supervised_head=False,
                parallel=ParallelShape(world_size=4, sequence_parallel=4), held_available=held)
    assert (four.rank_tokens, four.tokens, four.per_token) == (251, 1001, one.per_token)  # ceil(1001 / 4)
    assert four.activations == 251 * one.per_token and one.activations == 1001 * one.per_token
    assert four.head * 1001 == one.head * 251  # every position's logits: this rank's positions only
    assert (four.weights, four.gradients, four.optimizer) == (one.weights, one.gradients, one.optimizer)
    assert "1001 tokens in the largest micro batch / 4 sequence-parallel ranks = 251 per rank x" in four.line()
    assert "sequence-parallel" not in one.line()
    assert fitting_tokens(four) == 4 * fitting_tokens(plan(
        llama, tokens=251, checkpointing=False, optim="adamw_torch", supervised_head=False,
        parallel=ParallelShape(world_size=4), held_available=held))


def _sp_planner(llama, available, world, sp=1):
    return lambda on, tokens=None: plan(llama, tokens=tokens or 20_000, checkpointing=on, optim="adamw_torch",
                                        parallel=ParallelShape(world_size=world, sequence_parallel=sp),
                                        held_available=(GIB // 4, available, "test memory"))


@pytest.mark.parametrize("world,sp,fits_at,named", [
    (8, 1, 4, 4),        # 2 is too few, 4 fits: the smallest power of two that fits is named
    (8, 2, 4, 4),        # already 2: the next that fits
    (8, 1, 16, None),    # 16 would fit, but the world has 8 ranks
    (6, 1, 4, None),     # 4 does not divide 6, 2 does not fit
    (6, 1, 2, 2),
    (1, 1, 2, None),     # one process: nothing to split over
])
def test_a_refusal_names_the_sequence_parallel_size_that_fits(llama, world, sp, fits_at, named):
    from sft.train.memory_plan import fitting_sequence_parallel

    full = _sp_planner(llama, 0, world)(True)
    per_rank = -(-full.tokens // fits_at)
    # room for the activations and LM head of ceil(20000 / fits_at) tokens per rank, and not of twice as many
    fixed = full.peak - full.activations - full.head
    available = int((fixed + full.head_for(per_rank) + full.per_token * per_rank) / 0.9) + 1
    p = _sp_planner(llama, available, world, sp)(True)
    assert not p.fits
    assert fitting_sequence_parallel(p) == named
    with pytest.raises(SFTError) as e:
        choose_checkpointing(_sp_planner(llama, available, world, sp), True)
    text = str(e.value)
    if named is None:
        assert "--sequence_parallel_size" not in text
    else:
        assert f"--sequence_parallel_size {named} (the micro batch's 20000 tokens split over {named} ranks: " \
               f"{-(-20000 // named)} per rank)" in text
        assert _sp_planner(llama, available, world, named)(True).fits  # the size it names fits
        if named // 2 > sp:
            assert not _sp_planner(llama, available, world, named // 2)(True).fits


def test_checkpointed_activations_are_every_layer_input_and_a_few_layers(llama):
    """With checkpointing: every layer's input (layers x hidden x activation bytes) plus CHECKPOINTED_LAYERS layers'
    worth of what autograd keeps, never more than the plan without it; the supervised LM head is
    HEAD_BYTES_PER_LOGIT per logit of one chunk (at most MAX_LOGIT_ELEMENTS)."""
    from sft.model.loss import MAX_LOGIT_ELEMENTS
    from sft.train.memory_plan import BACKWARD_FACTOR, CHECKPOINTED_LAYERS, HEAD_BYTES_PER_LOGIT

    c = llama.config
    total, layer = 20_000.0 * c.num_hidden_layers, 20_000.0
    on, off = (plan(llama, tokens=10, checkpointing=ck, optim="sgd", measured=(total, layer),
                    held_available=(0, GIB, "test")) for ck in (True, False))
    assert on.per_token == int(c.num_hidden_layers * 4 * c.hidden_size + CHECKPOINTED_LAYERS[4] * layer)
    assert off.per_token == int(total * BACKWARD_FACTOR) > on.per_token
    shallow = plan(llama, tokens=10, checkpointing=True, optim="sgd", measured=(2 * layer, layer),
                   held_available=(0, GIB, "test"))
    assert c.num_hidden_layers * 4 * c.hidden_size + CHECKPOINTED_LAYERS[4] * layer > 2 * layer * BACKWARD_FACTOR
    assert shallow.per_token == int(2 * layer * BACKWARD_FACTOR)  # two layers' worth: checkpointing saves nothing
    assert on.head == int(HEAD_BYTES_PER_LOGIT * c.vocab_size) * 10
    big = plan(llama, tokens=10 ** 7, checkpointing=False, optim="sgd", held_available=(0, GIB, "test"))
    assert big.head == int(HEAD_BYTES_PER_LOGIT * MAX_LOGIT_ELEMENTS)


def test_expert_parallel_ranks_plan_their_share_of_the_experts():
    """--expert_parallel_size 2: this rank's plan counts half the experts' weights (the plan's parameter figures),
    gradients (once: DDP leaves them alone) and AdamW state; the rest as under DDP."""
    from sft.distributed.expert_parallel import ExpertParallel
    from sft.model.expert_parallel import shard_experts
    from sft.model.loading import apply_lora
    from sft.model.spec import LoraSpec
    from sft.train.counting import model_flops_per_token
    from tests.helpers.families import tiny_model

    def planned(size):
        model = apply_lora(tiny_model("qwen3_moe", vocab_size=128), None, False, LoraSpec(train_embeddings="false"))
        cut = shard_experts(model, ExpertParallel(size=size, rank=1, world_size=max(2, size)))
        model.sft_expert_shards = cut
        trainable = {n: q.numel() for n, q in model.named_parameters() if q.requires_grad}
        experts = sum(v for n, v in trainable.items() if ".experts." in n)  # this rank's expert LoRA
        p = plan(model, tokens=100, checkpointing=False, optim="adamw_torch", parallel=ParallelShape(world_size=2),
                 held_available=(GIB, 8 * GIB, "test"))
        p.flops = model_flops_per_token(model)
        return p, experts, sum(trainable.values()) - experts

    one, experts_one, dense = planned(1)
    two, experts_two, dense_two = planned(2)
    assert dense_two == dense and experts_two * 2 == experts_one > 0
    assert one.gradients == 2 * 4 * (dense + experts_one)  # DDP: every gradient twice (its buckets)
    assert two.gradients == 2 * 4 * dense + 4 * experts_one // 2  # expert gradients: half of them, once
    assert (one.optimizer, two.optimizer) == (8 * (dense + experts_one), 8 * (dense + experts_one // 2))
    assert two.parameters["experts"] * 2 == one.parameters["experts"] > 0  # the routed experts' weights
    # FLOPs per token (MFU): a token still runs top-2 experts, also where a rank keeps fewer than 2 (E/N = 1 of 8)
    assert one.flops == two.flops == planned(8)[0].flops > 0
