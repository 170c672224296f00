"""Sequence parallelism's batch split and group layout (pure: no process group)."""
import pytest
import torch

from sft.data.batches.packing import PackedCollator, PaddingFreeCollator, split_for_sequence_parallel
from sft.distributed.sequence_parallel import crossing_line, layout
from sft.errors import ConfigError
from sft.model.sequence_parallel import choose_mode, ulysses_problem

SAMPLES = [{"input_ids": [11, 12, 13, 14], "labels": [-100, -100, 13, 14]},
           {"input_ids": [21, 22, 23], "labels": [-100, 22, 23]},
           {"input_ids": [31, 32], "labels": [-100, 32]}]


def whole_row(batch, size):
    parts = [split_for_sequence_parallel(batch, size, r, pad_token_id=0) for r in range(size)]
    return parts, {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "position_ids", "shift_labels")}


@pytest.mark.parametrize("size", [2, 3, 4])
def test_padding_free_row_split_into_equal_slices_that_rebuild_the_shifted_row(size):
    batch = PaddingFreeCollator()(SAMPLES)  # 9 tokens, 3 documents
    parts, row = whole_row(batch, size)
    pad = (-9) % size
    assert all(p["input_ids"].shape == (1, (9 + pad) // size) for p in parts)
    assert row["input_ids"][0].tolist() == [11, 12, 13, 14, 21, 22, 23, 31, 32] + [0] * pad
    # labels shifted over the whole row before the split: a slice's last token predicts the next slice's first
    # token; the last token of a document predicts nothing (the next document's first label is -100)
    assert row["shift_labels"][0].tolist() == [-100, 13, 14, -100, 22, 23, -100, 32, -100] + [-100] * pad
    assert row["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1] + list(range(pad))
    cu = [0, 4, 7, 9] + ([9 + pad] if pad else [])
    for p in parts:  # every rank: the whole row's documents, the pad one included
        assert p["cu_seq_lens_q"].tolist() == cu and p["cu_seq_lens_k"].tolist() == cu
        assert p["max_length_q"] == 4 and torch.equal(p["labels"], p["shift_labels"])


def test_packed_rows_are_flattened_with_their_pad_documents():
    rows = [{"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5], "position_ids": [0, 1, 2, 0, 1]},
            {"input_ids": [6, 7, 8], "labels": [6, 7, 8], "position_ids": [0, 1, 2]}]
    batch = PackedCollator(pad_token_id=0)(rows)  # [2, 5]: the second row padded by a 2-token document
    parts, row = whole_row(batch, 2)
    assert row["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 0, 0]
    assert row["shift_labels"][0].tolist() == [2, 3, -100, 5, -100, 7, 8, -100, -100, -100]
    assert parts[0]["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 10]


def test_a_padded_batch_is_refused():
    with pytest.raises(ValueError, match="padding-free or packed rows"):
        split_for_sequence_parallel({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4),
                                     "attention_mask": torch.ones(1, 4)}, 2, 0)


def test_groups_are_consecutive_ranks_and_data_parallel_across_them():
    assert [layout(8, r, 4) for r in range(8)] == [(r % 4, 2, r // 4, r // 4 * 4) for r in range(8)]
    assert layout(2, 1, 1) == (0, 2, 1, 1)
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        layout(6, 0, 4)
    assert crossing_line(2, 8) is None and crossing_line(4, 0) is None
    assert "does not divide the 2 processes per node: some sequence-parallel groups span two nodes" in \
        crossing_line(4, 2)


class Config:
    def __init__(self, heads, kv):
        self.num_attention_heads, self.num_key_value_heads, self.hidden_size, self.num_hidden_layers = heads, kv, 576, 2


def test_mode_follows_the_heads():
    assert choose_mode(Config(4, 2), 2) == "ulysses"
    assert choose_mode(Config(8, 2), 4) == "ulysses"  # KV heads replicated: 4 is a multiple of 2
    assert choose_mode(Config(9, 3), 2) == "all_gather"  # SmolLM2-135M: 9 heads, 3 KV heads
    assert choose_mode(Config(4, 2), 2, "all_gather") == "all_gather"
    assert ulysses_problem(9, 3, 2) == "9 attention heads are not divisible by 2"
    assert ulysses_problem(12, 3, 2) == "3 KV heads neither divide nor are divisible by 2"
    with pytest.raises(ConfigError) as e:
        choose_mode(Config(9, 3), 2, "ulysses")
    assert str(e.value).count("\n  - ") == 1 and "use --sequence_parallel_mode all_gather" in str(e.value)
