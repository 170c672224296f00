"""--packing: rows of several conversations, position ids restarting, the per-row collator, the conflicts.
Attention kept inside each conversation: tests/unit/model/test_attention.py. Real SmolLM2 on real chitchat and the
trainer with packing in a training run are in tests/integration/data/test_packing.py."""

import pytest
import torch

from sft.app.validation import validate
from sft.config.arguments import parse_args
from sft.data.batches.packing import PackedCollator, PaddingFreeCollator, best_fit_decreasing, pack_dataset, split_row
from sft.data.template.chat import IGNORE_INDEX
from sft.errors import ConfigError


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
    seqs = [{"input_ids": list(range(10 * k, 10 * k + n)),
             "labels": [IGNORE_INDEX] + list(range(10 * k + 1, 10 * k + n))}
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
    batch = PackedCollator(pad_token_id=7)(rows)
    # no attention_mask: documents come from positions, and their boundaries once per micro batch
    # (sft/model/attention.py)
    assert set(batch) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                          "max_length_k"}
    lengths = [len(r["input_ids"]) for r in rows]
    # one row per packed row, padded to the longest row only (not flattened into [1, total])
    assert batch["input_ids"].shape == (2, max(lengths)) and batch["input_ids"].dtype == torch.int64
    for i, (r, n) in enumerate(zip(rows, lengths)):
        assert batch["input_ids"][i, :n].tolist() == r["input_ids"]
        assert batch["input_ids"][i, n:].tolist() == [7] * (max(lengths) - n)
        # the padding is a document of its own: position ids restart at 0 there, labels -100
        assert batch["position_ids"][i].tolist() == r["position_ids"] + list(range(max(lengths) - n))
        assert batch["labels"][i, n:].tolist() == [IGNORE_INDEX] * (max(lengths) - n)
        for s_, p in enumerate(r["position_ids"]):  # the first label of every conversation is -100, the rest kept
            assert batch["labels"][i, s_].item() == (IGNORE_INDEX if p == 0 else r["labels"][s_])
    assert min(lengths) < max(lengths)  # the check above did see padding


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


def test_packed_rows_count_the_same_supervised_tokens_as_padded_batches(qwen_tok, toy_data):
    """The Trainer divides the summed loss by ``num_items_in_batch`` = labels[..., 1:] != -100 over the micro batches
    of one optimizer step (and across ranks with average_tokens_across_devices): packed rows must count exactly the
    padded batches' supervised tokens, so the loss is normalised as in the unpacked run."""
    from sft.data.records.records import load_conversations
    from sft.data.store.dataset import make_collator
    from sft.data.template.chat import encode_conversations

    tok, eot = qwen_tok
    convs = [c.messages for c in load_conversations(toy_data, "error")]
    samples = [{"input_ids": i, "labels": l} for i, l in encode_conversations(tok, convs, eot)]
    ds, report = pack_dataset(samples, 96)
    assert 1 < report.rows < len(samples)  # several conversations per row, several rows
    packed = PackedCollator(tok.pad_token_id)(list(ds))
    padded = make_collator(tok)(samples)
    free = PaddingFreeCollator()(samples)  # --padding_free (the default): one row, no padding
    assert free["input_ids"].shape == (1, sum(len(s["input_ids"]) for s in samples)) and "attention_mask" not in free
    count = lambda b: int((b["labels"][..., 1:] != IGNORE_INDEX).sum())  # transformers 5.24 _get_num_items_in_batch
    assert count(packed) == count(padded) == count(free) == \
        sum(sum(x != IGNORE_INDEX for x in s["labels"]) for s in samples)
    assert count(padded) > 0
