"""--packing with real models: the real SmolLM2 on real chitchat conversations (per-conversation losses of a
packed row equal one forward per conversation), and the trainer's packed rows give the unpacked loss, then
train. The packing itself (bins, rows, position ids, attention kept inside each conversation on the tiny model,
conflicts) is checked in process in tests/unit/data/test_packing.py."""
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from sft.app.train import trainer_for
from sft.data.batches.packing import PackedCollator, PaddingFreeCollator, pack_dataset, split_row
from sft.data.records.records import load_conversations
from sft.data.store.dataset import make_collator
from sft.data.template.chat import IGNORE_INDEX, encode_conversations
from sft.model.attention import PACKED_ATTENTION, check_packing_support
from tests.helpers.data import TOY, write_jsonl
from tests.unit.data.test_packing import train_args


@pytest.fixture(scope="module")
def chitchat(tmp_path_factory):
    """40 real chitchat conversations, written from the chitchat-dataset package (no prepared example needed)."""
    from scripts import prepare_example

    return write_jsonl(tmp_path_factory.mktemp("chitchat") / "chitchat40.jsonl", prepare_example.chitchat_records(40))


def conv_losses(model, ids, labels, position_ids=None):
    """Summed cross-entropy and supervised-token count per conversation of one packed row."""
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits[0]
    tok_loss = F.cross_entropy(logits[:-1], labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="none")
    return tok_loss, logits


@pytest.fixture(scope="module")
def smol_model(smol_dir):
    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


def test_per_conversation_losses_equal_unpacked_run(smol_model, smol_tok, chitchat):
    """Real SmolLM2 (sdpa) on real chitchat conversations: packed vs. one forward per conversation."""
    tok, eot = smol_tok
    convs = load_conversations(chitchat, "error")[:40]
    encoded = [(i[:72], l[:72]) for i, l in encode_conversations(tok, [c.messages for c in convs], eot)]
    encoded = [e for e in encoded if any(x != IGNORE_INDEX for x in e[1])][:4]
    assert check_packing_support(smol_model) == PACKED_ATTENTION
    ds, report = pack_dataset([{"input_ids": i, "labels": l} for i, l in encoded], 1024)
    assert report.rows == 1
    batch = PackedCollator()(list(ds))
    tok_loss, _ = conv_losses(smol_model, batch["input_ids"], batch["labels"], batch["position_ids"])
    pos = batch["position_ids"][0].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    packed, plain_concat = {}, {}
    naive_loss, _ = conv_losses(smol_model, batch["input_ids"], batch["labels"])  # positions 0..T-1, one causal mask
    for s, e in zip(starts, starts[1:]):
        ids = tuple(batch["input_ids"][0, s:e].tolist())
        sup = (batch["labels"][0, s + 1:e] != IGNORE_INDEX).sum().item()
        # token t predicts label t+1: the slice [s, e-1) of tok_loss covers this conversation's targets
        packed[ids] = tok_loss[s:e - 1].sum().item() / sup
        plain_concat[ids] = naive_loss[s:e - 1].sum().item() / sup
    assert len(packed) == 4
    diffs = []
    for ids, labels in encoded:
        t_ids, t_lab = torch.tensor([ids]), torch.tensor([labels])
        alone, _ = conv_losses(smol_model, t_ids, t_lab)
        ref = alone.sum().item() / (t_lab[0, 1:] != IGNORE_INDEX).sum().item()
        assert packed[tuple(ids)] == pytest.approx(ref, rel=1e-4, abs=1e-4)
        diffs.append(abs(plain_concat[tuple(ids)] - ref))
    # control: plain concatenation (no restart, attention crossing) gives different losses, so the check can fail
    assert max(diffs) > 1e-2, diffs


def test_trainer_with_packing_matches_unpacked_loss(tiny_model_dir, toy_data, tmp_path):
    args = train_args(tiny_model_dir, toy_data, tmp_path / "p", "--packing", "True", "--model_max_length", "64",
                      "--per_device_train_batch_size", "2", "--max_steps", "2")
    trainer, tok, _ = trainer_for(*args)
    assert trainer.model.get_base_model().config._attn_implementation == PACKED_ATTENTION
    ds = trainer.train_dataset
    assert len(ds) < len(TOY) and sum(len(r["input_ids"]) for r in ds) == sum(
        len(c["input_ids"]) for r in ds for c in split_row(r))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 2 and "attention_mask" not in batch  # one row per packed row
    convs = [c for r in [ds[i] for i in range(len(ds))] for c in split_row(r)]
    model = trainer.model.eval()
    with torch.no_grad():
        packed = model(**PackedCollator(tok.pad_token_id)(list(ds))).loss  # every row at once, pad documents
        padded = make_collator(tok)(convs)
        unpacked = model(**padded, use_cache=False).loss
    assert padded["attention_mask"].sum() < padded["attention_mask"].numel()  # the unpacked batch has padding
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-5)
    model.train()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < x < 100 for x in losses)


def test_padding_free_default_learns_as_padded_batches(tiny_model_dir, toy_data, tmp_path):
    """The default (--padding_free True): one [1, tokens] row per micro batch, no mask; the same loss and gradients
    as the padded micro batch of the same samples (rtol 1e-5 / atol 1e-6 on the loss, rtol 1e-4 / atol 1e-6 on
    gradients, fp32). --padding_free False restores the padded batches."""
    args = train_args(tiny_model_dir, toy_data, tmp_path / "f", "--per_device_train_batch_size", "4",
                      "--max_steps", "1")
    trainer, tok, _ = trainer_for(*args)
    assert trainer.model.get_base_model().config._attn_implementation == PACKED_ATTENTION
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    features = [{k: trainer.train_dataset[i][k] for k in ("input_ids", "labels")} for i in range(4)]
    model = trainer.model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    free = model(**PaddingFreeCollator()(features)).loss
    free_grads = torch.autograd.grad(free, params)
    padded_batch = make_collator(tok)(features)
    assert padded_batch["attention_mask"].sum() < padded_batch["attention_mask"].numel()  # there is padding
    padded = model(**padded_batch).loss
    padded_grads = torch.autograd.grad(padded, params)
    torch.testing.assert_close(free, padded, rtol=1e-5, atol=1e-6)
    for f, p in zip(free_grads, padded_grads):
        torch.testing.assert_close(f, p, rtol=1e-4, atol=1e-6)
    assert max(p.abs().max().item() for p in padded_grads) > 1e-4  # LoRA B starts at 0: A's gradients are 0, B's not
    trainer.train()
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h][0] > 0
    args = train_args(tiny_model_dir, toy_data, tmp_path / "p", "--per_device_train_batch_size", "4",
                      "--max_steps", "1", "--padding_free", "False")
    trainer, _, _ = trainer_for(*args)
    assert "attention_mask" in next(iter(trainer.get_train_dataloader()))
    assert trainer.model.get_base_model().config._attn_implementation == "sdpa"


def test_the_trainer_feeds_the_budgeted_micro_batches_largest_first(tiny_model_dir, toy_data, tmp_path, caplog):
    """Padding-free micro batches under a token budget reach the model through the Trainer's own data loader (a
    batch sampler, one [1, tokens] row each), the largest first, and the memory plan names that micro batch."""
    from sft.train.trainer import TokenBudgetBatchSampler

    args = train_args(tiny_model_dir, toy_data, tmp_path / "o", "--per_device_train_batch_size", "8",
                      "--model_max_length", "64", "--max_tokens_per_micro_batch", "64", "--max_steps", "1")
    with caplog.at_level(logging.INFO, logger="sft"):
        trainer, _, _ = trainer_for(*args)
    sampler = trainer.train_batch_sampler
    assert isinstance(sampler, TokenBudgetBatchSampler) and sampler.max_tokens == 64
    rows = [b["input_ids"] for b in trainer.get_train_dataloader()]
    assert len(rows) == len(sampler) and all(r.shape[0] == 1 and r.shape[1] <= 64 for r in rows)
    assert rows[0].shape[1] == sampler.largest_tokens == max(r.shape[1] for r in rows)
    plan_line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan: weights"))
    assert f"({sampler.largest_tokens} tokens in the largest micro batch" in plan_line \
        and "checkpointing off" in plan_line


def test_an_unset_budget_is_micro_batch_x_max_length_and_lowered_when_memory_is_short(tiny_model_dir, toy_data,
                                                                                       tmp_path, caplog, monkeypatch):
    """Unset, the token budget splits no micro batch (micro batch x --model_max_length); when the plan does not fit,
    the micro batches are formed again under the budget that fits, before gradient checkpointing is considered
    (memory made short by a plan whose available memory leaves room for about 100 tokens of activations)."""
    import dataclasses

    import sft.app.train as app_train
    import sft.train.memory_plan as mp

    args = train_args(tiny_model_dir, toy_data, tmp_path / "a", "--per_device_train_batch_size", "8",
                      "--model_max_length", "64", "--max_steps", "1")
    trainer, _, _ = trainer_for(*args)
    assert trainer.train_batch_sampler.max_tokens == 8 * 64 and trainer.train_batch_sampler.largest_tokens > 100
    real_plan = mp.plan

    def short(*a, **kw):
        p = real_plan(*a, **kw)
        return dataclasses.replace(p, available=int((p.peak - p.activations + 100 * p.per_token) / mp.FIT) + 1)

    monkeypatch.setattr(app_train, "plan", short)  # where build_trainer's memory step calls it
    args = train_args(tiny_model_dir, toy_data, tmp_path / "b", "--per_device_train_batch_size", "8",
                      "--model_max_length", "64", "--max_steps", "1")
    with caplog.at_level(logging.INFO, logger="sft"):
        trainer, _, _ = trainer_for(*args)
    sampler = trainer.train_batch_sampler
    assert 64 <= sampler.max_tokens <= 101 and args[2].max_tokens_per_micro_batch == sampler.max_tokens
    assert any(r.getMessage().startswith(f"token budget {sampler.max_tokens} per micro batch") for r in caplog.records)
    rows = [b["input_ids"] for b in trainer.get_train_dataloader()]
    assert rows[0].shape[1] == sampler.largest_tokens <= sampler.max_tokens
    assert not trainer.args.gradient_checkpointing  # a smaller budget rather than recomputation
