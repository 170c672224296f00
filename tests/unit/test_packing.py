"""--packing: rows of several conversations, position ids restarting, attention kept inside each conversation
(the tiny model), the conflicts. Real SmolLM2 on real chitchat and the trainer with packing in a training run are
in tests/integration/test_packing.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from sft.arguments import parse_args, validate
from sft.chat import IGNORE_INDEX
from sft.errors import ConfigError
from sft.packing import PackedCollator, best_fit_decreasing, check_packing_support, pack_dataset, split_row


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
