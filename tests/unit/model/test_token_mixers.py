"""A packed row of a hybrid model equals its documents run alone: loss and every gradient (sft/model/token_mixers.py).

Tiny random fp32 models (vocabulary 128) of every family of :data:`tests.helpers.families.HYBRID`; documents of 70,
1, 9 and 4 tokens: different lengths, a one-token document, and one longer than the convolution window (4) and the
recurrences' chunks (64 for the gated delta rule and KDA's PyTorch paths, 8 for the tiny Mamba2 configs). Both
layouts: the padding-free row (:class:`sft.data.batches.packing.PaddingFreeCollator`, one row) and ``--packing`` rows
(:class:`sft.data.batches.packing.PackedCollator`, two rows, the second padded). Granite-4.0 hybrid and Zamba too, whose
decoder layers hand their attention no position ids (the attention reads the decoder's boundaries).
"""
from __future__ import annotations

import pytest
import torch

from sft.data.batches.packing import PackedCollator, PaddingFreeCollator
from sft.model.attention import check_packing_support, use_packed_attention
from sft.model.token_mixers import PAD_WASTE, find_token_mixers, keep_documents_apart, mixer_kinds, plan_groups
from tests.helpers.families import HYBRID, HYBRID_MORE, tiny_model

LENGTHS = (70, 1, 9, 4)
REL = 1e-5  # the loss, and all gradients together (norm of the difference / norm)
# each gradient tensor alone: the gated delta rule's A_log / dt_bias gradients are sums over every position with
# much cancellation; the MoE hybrids' experts see the tokens grouped otherwise than alone and reach 1.8e-5 there
# (an attention-only MoE, qwen3_moe, gives 8e-7 on its own tensors); a leak gives > 1e-3 (LFM2 below)
REL_TENSOR = 1e-4


def _docs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in LENGTHS]


def _loss_sum(model, batch) -> torch.Tensor:
    """Summed next-token cross entropy over supervised positions (-100 skipped), as the loss of every row."""
    labels = batch.pop("labels")
    logits = model(**batch).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _alone(model, docs):
    total = 0.0
    for ids in docs:
        t = torch.tensor([ids])
        total = total + _loss_sum(model, {"input_ids": t, "labels": t.clone()})
    return total


def _packed_batch(layout: str, docs):
    if layout == "padding_free":
        return PaddingFreeCollator()([{"input_ids": d, "labels": d} for d in docs])
    rows = [docs[:2], docs[2:]]  # [70, 1] and [9, 4] + padding to 71
    feats = [{"input_ids": sum(r, []), "labels": sum(r, []), "position_ids": sum((list(range(len(d))) for d in r), [])}
             for r in rows]
    return PackedCollator(pad_token_id=0)(feats)


def _assert_equal_to_alone(model, layout: str):
    docs = _docs()
    packed = _loss_sum(model, _packed_batch(layout, docs))
    g_packed = _grads(model, packed)
    alone = _alone(model, docs)
    g_alone = _grads(model, alone)
    rel = abs(packed.item() - alone.item()) / abs(alone.item())
    assert rel <= REL, f"relative loss difference {rel:.2e}"
    assert g_packed.keys() == g_alone.keys()
    diff = torch.cat([(g_packed[n] - g).flatten() for n, g in g_alone.items()])
    whole = (diff.norm() / torch.cat([g.flatten() for g in g_alone.values()]).norm()).item()
    assert whole <= REL, f"relative difference of all gradients {whole:.2e}"
    worst = max((((g_packed[n] - g).norm() / g.norm()).item(), n) for n, g in g_alone.items() if g.norm() > 0)
    assert worst[0] <= REL_TENSOR, f"relative gradient difference {worst[0]:.2e} in {worst[1]}"


def _prepare(model, layout: str):
    if layout == "packing":
        check_packing_support(model)
    else:
        assert use_packed_attention(model)
    return keep_documents_apart(model)


@pytest.mark.parametrize("layout", ["padding_free", "packing"])
@pytest.mark.parametrize("family", HYBRID + HYBRID_MORE)
def test_packed_row_equals_documents_alone(family, layout):
    model = tiny_model(family, vocab_size=128)
    assert _prepare(model, layout), f"{family}: no token mixer found"
    _assert_equal_to_alone(model, layout)


@pytest.mark.parametrize("lengths", [[70, 1, 9, 4], [1024, 560, 630, 193, 836, 764, 708, 360], [5] * 6, [1], [2, 300]])
def test_documents_are_grouped_within_the_padding_bound(lengths):
    """Every document in exactly one group, longest first; a group's padded positions at most PAD_WASTE times its
    real ones; documents of close lengths share a call (the tests above run the padded groups: 70 | 9, 4 | 1)."""
    groups = plan_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert [lengths[i] for i in g] == sorted((lengths[i] for i in g), reverse=True)
        assert len(g) * lengths[g[0]] <= PAD_WASTE * sum(lengths[i] for i in g)
    expected = {(70, 1, 9, 4): [[0], [2, 3], [1]], (5,) * 6: [list(range(6))], (2, 300): [[1], [0]]}
    assert groups == expected.get(tuple(lengths), groups)
    assert len(plan_groups([1024, 560, 630, 193, 836, 764, 708, 360])) == 2  # one call for 7 of the 8, one for 193


def test_without_the_rule_short_convolutions_leak():
    """The check above can fail: LFM2's short convolutions, left alone, carry one document into the next."""
    model = tiny_model("lfm2", vocab_size=128)
    assert use_packed_attention(model)
    with pytest.raises(AssertionError, match="relative"):
        _assert_equal_to_alone(model, "padding_free")


def test_lora_and_gradient_checkpointing_keep_the_rule():
    """Under a LoRA wrapper and with activation checkpointing (the mixers recomputed in backward) the row stays equal
    to its documents alone."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("qwen3_5_text", vocab_size=128)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["in_proj_qkv", "out_proj", "q_proj", "v_proj"]))
    model.train()
    assert _prepare(model, "padding_free") == ["Qwen3_5GatedDeltaNet"]
    assert keep_documents_apart(model) == ["Qwen3_5GatedDeltaNet"]  # idempotent: wrapped once
    _assert_equal_to_alone(model, "padding_free")


def test_mixers_found_by_what_they_hold():
    """Attention-only models have none; a hybrid's mixers are the decoder-layer children holding the convolution."""
    assert find_token_mixers(tiny_model("mixtral", vocab_size=128)) == []
    jamba = tiny_model("jamba", vocab_size=128)
    keys = list(jamba.state_dict())
    found = find_token_mixers(jamba)
    assert [name for name, _, _ in found] == ["layers.0.mamba", "layers.1.mamba", "layers.3.mamba"]
    assert keep_documents_apart(jamba) == ["JambaMambaMixer"]
    assert list(jamba.state_dict()) == keys  # the forward is replaced on the instance: no new names
    assert mixer_kinds(tiny_model("lfm2", vocab_size=128)) == ["Lfm2ShortConv"]


def test_sequence_parallelism_refused_from_the_config(toy_data, tmp_path):
    """Validation builds the folder's config on the meta device and refuses --sequence_parallel_size 2 in one line
    naming the layer kind; an attention-only model is not refused."""
    from sft.app.validation import validate
    from sft.config.arguments import parse_args
    from sft.errors import ConfigError
    from sft.model.token_mixers import sequence_parallel_problem
    from tests.helpers.families import tiny_config

    hybrid, plain = tmp_path / "hybrid", tmp_path / "plain"
    tiny_config("nemotron_h", vocab_size=128).save_pretrained(hybrid)
    tiny_config("mixtral", vocab_size=128).save_pretrained(plain)
    args = parse_args(["--model_name_or_path", str(hybrid), "--data_path", toy_data, "--output_dir",
                       str(tmp_path / "o"), "--sequence_parallel_size", "2", "--report_to", "none"])
    with pytest.raises(ConfigError) as e:
        validate(*args)
    assert [p for p in e.value.problems if "NemotronHMamba2Mixer" in p][0].startswith("--sequence_parallel_size 2:")
    assert sequence_parallel_problem(2, str(plain)) == [] and sequence_parallel_problem(1, str(hybrid)) == []
