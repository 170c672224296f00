"""--packing: rows of several conversations, position ids restarting, attention kept inside each conversation.
The trainer with packing in a training run is in tests/integration/test_packing.py."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from sft.arguments import parse_args, validate
from sft.chat import IGNORE_INDEX, encode_conversations
from sft.data import load_conversations
from sft.errors import ConfigError
from sft.packing import PackedCollator, best_fit_decreasing, check_packing_support, pack_dataset, split_row
from tests.helpers.data import write_jsonl


@pytest.fixture(scope="module")
def chitchat(tmp_path_factory):
    """40 real chitchat conversations, written from the chitchat-dataset package (no prepared example needed)."""
    from scripts import prepare_example

    return write_jsonl(tmp_path_factory.mktemp("chitchat") / "chitchat40.jsonl", prepare_example.chitchat_records(40))


def test_best_fit_decreasing_fills_bins_within_capacity():
    lengths = [5, 4, 3, 3, 2, 1, 8, 6]
    bins = best_fit_decreasing(lengths, 8)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # each item exactly once
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4  # 32 tokens, capacity 8: a perfect packing exists and BFD finds it
    assert best_fit_decreasing(lengths, 8) == bins  # deterministic
    with pytest.raises(ValueError, match="outside"):
        best_fit_decreasing([3, 9], 8)


def test_pack_dataset_rows_and_collator():
    seqs = [{"input_ids": list(range(10 * k, 10 * k + n)), "labels": [IGNORE_INDEX] + list(range(10 * k + 1, 10 * k + n))}
            for k, n in enumerate([5, 3, 4, 2])]
    ds, report = pack_dataset(seqs, 8)
    assert report.rows == 2 and report.tokens == 14 and report.conversations == 4
    rows = list(ds)
    assert all(len(r["input_ids"]) <= 8 for r in rows)
    back = sorted((c for r in rows for c in split_row(r)), key=lambda c: c["input_ids"][0])
    assert back == seqs  # rows split back into exactly the original conversations
    for r in rows:  # position ids restart at every conversation start
        for c_start in [i for i, p in enumerate(r["position_ids"]) if p == 0]:
            assert r["input_ids"][c_start] % 10 == 0
    batch = PackedCollator()(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: masking comes from positions
    assert batch["input_ids"].shape == (1, 14) and batch["input_ids"].dtype == torch.int64
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert len(starts) == 4 and all(batch["labels"][0, s] == IGNORE_INDEX for s in starts)


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
    assert check_packing_support(smol_model) == "sdpa"
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


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_attention_does_not_cross_conversations(tiny_model_dir, attn):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    assert check_packing_support(model) == attn
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 1000, (13,), generator=g).tolist(), torch.randint(0, 1000, (9,), generator=g).tolist()
    other_a = torch.randint(1000, 2000, (17,), generator=g).tolist()  # different tokens and a different length

    def b_logits(first, restart=True):
        rows = [{"input_ids": first, "labels": first}, {"input_ids": b, "labels": b}]
        batch = PackedCollator()([{**r, "position_ids": list(range(len(r["input_ids"])))} for r in rows])
        pos = batch["position_ids"] if restart else torch.arange(len(first) + len(b))[None]
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], position_ids=pos, use_cache=False).logits
        return logits[0, len(first):]

    with torch.no_grad():
        alone = model(input_ids=torch.tensor([b]), use_cache=False).logits[0]
    torch.testing.assert_close(b_logits(a), alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b_logits(other_a), alone, rtol=1e-5, atol=1e-5)
    # control: without restarting position ids the same row is one causal sequence and B sees A
    assert (b_logits(a, restart=False) - b_logits(other_a, restart=False)).abs().max() > 1e-3


def train_args(model_dir, data, out, *extra):
    args = parse_args(["--model_name_or_path", model_dir, "--data_path", data, "--output_dir", str(out),
                       "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--seed", "0",
                       "--disable_tqdm", "True", "--use_lora", "True", "--lora_r", "4", "--lora_dropout", "0.0",
                       *extra])
    validate(*args)
    return args


@pytest.mark.parametrize("extra,msg", [(["--lazy_preprocess", "True"], "--lazy_preprocess"),
                                       (["--group_by_length", "True"], "--group_by_length")])
def test_packing_conflicts_are_reported(tiny_model_dir, toy_data, tmp_path, extra, msg):
    with pytest.raises(ConfigError, match=msg):
        train_args(tiny_model_dir, toy_data, tmp_path / "c", "--packing", "True", *extra)
