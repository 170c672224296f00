"""Per-conversation attention for packed rows (sft/model/attention.py) with the per-row packed collator
(sft/data/batches/packing.py): each conversation's logits and gradients inside a packed micro batch equal those of the
conversation alone, for every attention implementation --packing offers, on two architectures (tiny Qwen2 with GQA,
tiny Llama as SmolLM2), in train and eval mode; padded batches keep their mask; the controls show the checks can fail.

Tolerance: fp32, rtol = atol = 1e-5 for logits, rtol 1e-4 / atol 1e-5 for gradients (summation order differs
between one forward per conversation and one packed forward; measured differences are ~1e-7)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from sft.data.batches.packing import PackedCollator
from sft.data.template.chat import IGNORE_INDEX
from sft.model.attention import (
    PACKED_ATTENTION,
    check_packing_support,
    document_bounds,
    flash_varlen_available,
    packed_mask,
    use_packed_attention,
)

PAD = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}


def tiny_llama(attn="sdpa"):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.1)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(attn)
    return model


@pytest.fixture(params=["qwen2", "llama"])
def arch(request, tiny_model_dir):
    return request.param, tiny_model_dir


IMPLEMENTATIONS = [PACKED_ATTENTION, "eager", pytest.param("flash_varlen", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_varlen_available()),
    reason="flash-attn varlen needs CUDA and flash-attn"))]


def load(arch, impl):
    name, qwen_dir = arch
    base = "eager" if impl == "eager" else "sdpa"
    if name == "qwen2":
        model = AutoModelForCausalLM.from_pretrained(qwen_dir, attn_implementation=base, dtype=torch.float32)
    else:
        model = tiny_llama(base)
    if impl == "flash_varlen":
        model = model.to("cuda", torch.bfloat16)
    assert check_packing_support(model) == (PACKED_ATTENTION if base == "sdpa" else "eager")
    assert model.config.use_cache is False  # no KV cache in train or eval
    return model


def docs(vocab_hi=500):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, vocab_hi, (n,), generator=g).tolist() for n in (13, 9, 17, 5)]


def packed_batch(convs):
    """Two rows: [conv0, conv1] and [conv2, conv3] (the second row is shorter: padded with a pad document)."""
    rows = []
    for pair in (convs[:2], convs[2:]):
        rows.append({"input_ids": sum(pair, []), "labels": sum(pair, []),
                     "position_ids": [p for c in pair for p in range(len(c))]})
    return PackedCollator(PAD)(rows)


def where(convs):
    """(row, start) of each conversation in packed_batch."""
    return [(0, 0), (0, len(convs[0])), (1, 0), (1, len(convs[2]))]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_each_conversation_in_a_pack_equals_it_alone(arch, impl, mode):
    model = load(arch, impl)
    model.train(mode == "train")
    device = next(model.parameters()).device
    convs = docs()
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed_batch(convs).items()}
    assert "attention_mask" not in batch and batch["input_ids"].shape == (2, 22)
    tol = TOL if impl != "flash_varlen" else {"rtol": 2e-2, "atol": 2e-2}  # bf16 on GPU
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        for conv, (r, s) in zip(convs, where(convs)):
            alone = model(input_ids=torch.tensor([conv], device=device)).logits[0]
            torch.testing.assert_close(packed[r, s:s + len(conv)], alone, **tol)
        # control: an all-ones attention mask makes each row one sequence, and the second conversation sees the first
        leak = model(input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"])).logits
        alone = model(input_ids=torch.tensor([convs[1]], device=device)).logits[0]
        assert (leak[0, len(convs[0]):22] - alone).abs().max() > 1e-3


def conv_loss_sum(logits, labels):
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("impl", [PACKED_ATTENTION, "eager"])
def test_gradients_of_a_pack_equal_the_conversations_alone(arch, impl):
    model = load(arch, impl).train()
    params = [p for p in model.parameters() if p.requires_grad]
    convs = docs()
    batch = packed_batch(convs)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    packed_loss = sum(conv_loss_sum(logits[r], batch["labels"][r]) for r in range(2))
    packed_grads = torch.autograd.grad(packed_loss, params)
    alone_loss = 0
    for conv in convs:
        ids = torch.tensor([conv])
        alone_loss = alone_loss + conv_loss_sum(model(input_ids=ids).logits[0], ids[0])
    alone_grads = torch.autograd.grad(alone_loss, params)
    torch.testing.assert_close(packed_loss, alone_loss, **TOL)
    for p, a in zip(packed_grads, alone_grads):
        torch.testing.assert_close(p, a, rtol=1e-4, atol=1e-5)
    assert max(a.abs().max().item() for a in alone_grads) > 1e-3  # the gradients are not all ~0


def test_padded_batches_keep_their_mask_under_the_packed_implementation(tiny_model_dir):
    """A 2-D padding mask (padded evaluation, generation) goes through SDPA's own mask, unchanged."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert use_packed_attention(model) and model.config._attn_implementation == PACKED_ATTENTION
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits * mask[..., None],
                                   ref(input_ids=ids, attention_mask=mask).logits * mask[..., None], **TOL)
        out = model.generate(input_ids=ids[:1, :3], max_new_tokens=3, do_sample=False, use_cache=True)
        ref_out = ref.generate(input_ids=ids[:1, :3], max_new_tokens=3, do_sample=False, use_cache=True)
    assert out.tolist() == ref_out.tolist()


def test_document_bounds_and_mask_function():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert document_bounds(pos, 2) == [[(0, 3), (3, 5), (5, 6)], [(0, 6)]]
    assert document_bounds(pos[:1], 3) == [[(0, 3), (3, 5), (5, 6)]] * 3  # shared position ids
    assert packed_mask(2, 6, 6) is None  # no padding mask: documents come from the position ids
    mask = packed_mask(1, 3, 3, attention_mask=torch.tensor([[True, True, False]]), allow_is_causal_skip=False)
    assert mask.shape == (1, 1, 3, 3) and not mask[0, 0, 2, 2] and mask[0, 0, 1, 0] and not mask[0, 0, 0, 1]


def test_models_that_need_a_mask_keep_their_implementation(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.use_sliding_window, model.config.sliding_window = True, 4
    assert use_packed_attention(model) is False and model.config._attn_implementation == "sdpa"
    assert model.config.use_cache is False


def test_a_call_that_cannot_tell_samples_apart_is_refused():
    """No mask and no position ids (a model that does not pass them to its attention): refused, never one sequence."""
    from sft.model.attention import packed_attention_forward

    module = torch.nn.Module()
    q = torch.randn(1, 2, 3, 8).repeat(1, 1, 2, 1)  # two equal halves
    with pytest.raises(ValueError, match="position_ids"):
        packed_attention_forward(module, q, q, q, None)
    out, _ = packed_attention_forward(module, q, q, q, None, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    torch.testing.assert_close(out[:, 3:], out[:, :3])  # two equal documents, each attending only to itself
    with pytest.raises(ValueError, match="sliding window"):
        packed_attention_forward(module, q, q, q, None, position_ids=torch.arange(6)[None], sliding_window=4)


# ------------------------------------------------------------------- one attention call per layer (issue 30)

def block_diagonal_reference(q, k, v, offsets, scale=None):
    """SDPA over the flattened rows with a block-diagonal causal mask built from ``offsets``: the reference every
    one-call path must equal per document. q ``[B, H, L, D]``, k/v ``[B, KV, L, D]``; returns ``[B, L, H, D]``."""
    b, h, n, d = q.shape
    rep = h // k.shape[1]
    flat = [t.transpose(0, 1).reshape(t.shape[1], b * n, d)[None] for t in (q, k.repeat_interleave(rep, 1),
                                                                          v.repeat_interleave(rep, 1))]
    doc = torch.zeros(b * n, dtype=torch.int64)
    for i, s in enumerate(offsets[1:-1]):
        doc[s:] = i + 1
    idx = torch.arange(b * n)
    mask = (doc[:, None] == doc[None, :]) & (idx[:, None] >= idx[None, :])
    out = F.scaled_dot_product_attention(*flat, attn_mask=mask, scale=scale)[0]  # [H, B*N, D]
    return out.reshape(h, b, n, d).permute(1, 2, 0, 3)


def fake_varlen(gqa_native: bool, causal_as: str):
    """A CPU stand-in with the calling convention of torch's CUDA-only ``varlen_attn`` (flattened ``[tokens, heads,
    dim]`` tensors, cumulative offsets, longest lengths; causal as ``is_causal`` or ``window_size=(-1, 0)``;
    ``enable_gqa`` only where ``gqa_native``), computed one document at a time: it checks what sft sends it."""
    def body(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, causal=False, gqa=False):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
        offsets = cu_q.tolist()
        assert max_q == max(e - s for s, e in zip(offsets, offsets[1:]))
        assert causal and gqa == gqa_native and (gqa or k.shape[1] == q.shape[1])
        parts = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                                is_causal=True, scale=scale, enable_gqa=gqa).transpose(0, 1)
                 for s, e in zip(offsets, offsets[1:])]
        return torch.cat(parts)

    if causal_as == "is_causal":
        if gqa_native:
            def fn(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, is_causal=False, enable_gqa=False):
                return body(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=is_causal, gqa=enable_gqa)
        else:
            def fn(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, is_causal=False):
                return body(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=is_causal)
    else:
        def fn(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1), enable_gqa=False):
            return body(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=tuple(window_size) == (-1, 0),
                        gqa=enable_gqa)
    return fn


def test_the_path_per_device_package_and_torch_version(monkeypatch):
    """flash-attn's varlen where installed, else torch's varlen_attn where this torch has it (and no dropout), else
    the per-document SDPA loop; CPU and fp32 always take the loop."""
    from sft.model import attention

    monkeypatch.setattr(attention, "flash_varlen_available", lambda: True)
    assert attention.varlen_kernel("cuda", torch.bfloat16) == "flash_attn"
    assert attention.varlen_kernel("cuda", torch.float16, dropout=0.1) == "flash_attn"
    assert attention.varlen_kernel("cuda", torch.float32) == "sdpa_loop"
    assert attention.varlen_kernel("cpu", torch.bfloat16) == "sdpa_loop"
    monkeypatch.setattr(attention, "flash_varlen_available", lambda: False)
    monkeypatch.setattr(attention, "torch_varlen_function", lambda: fake_varlen(True, "window"))
    assert attention.varlen_kernel("cuda", torch.bfloat16) == "torch_varlen"
    assert attention.varlen_kernel("cuda", torch.bfloat16, dropout=0.1) == "sdpa_loop"  # varlen_attn has no dropout
    monkeypatch.setattr(attention, "torch_varlen_function", lambda: (lambda q, k, v, cu, m: q))  # no causal form
    assert attention.varlen_kernel("cuda", torch.bfloat16) == "sdpa_loop"
    monkeypatch.setattr(attention, "torch_varlen_function", lambda: None)  # a torch without varlen_attn
    assert attention.varlen_kernel("cuda", torch.bfloat16) == "sdpa_loop"


def test_the_varlen_signature_is_read_not_assumed():
    from sft.model.attention import torch_varlen_function, varlen_call_options

    assert varlen_call_options(fake_varlen(True, "is_causal")) == {"is_causal": True, "enable_gqa": True}
    assert varlen_call_options(fake_varlen(False, "is_causal")) == {"is_causal": True}
    assert varlen_call_options(fake_varlen(True, "window")) == {"window_size": (-1, 0), "enable_gqa": True}
    assert varlen_call_options(lambda q, k, v: q) is None
    # torch 2.13's own (requirements.txt): causal as a window (its is_causal = window_size == (-1, 0)), GQA native
    assert varlen_call_options(torch_varlen_function()) == {"window_size": (-1, 0), "enable_gqa": True}


@pytest.mark.parametrize("gqa_native,causal_as", [(True, "window"), (False, "is_causal"), (True, "is_causal")])
def test_one_varlen_call_equals_the_block_diagonal_reference(gqa_native, causal_as):
    """Two rows of 11 tokens holding 5 documents, 4 query heads over 2 key/value heads: the one-call path (with the
    stand-in kernel) gives each document what the block-diagonal causal mask gives it, boundaries from the collator."""
    from sft.model.attention import _torch_varlen

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 11, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    offsets = [0, 4, 9, 11, 18, 22]  # row 0: 4 + 5 + 2 tokens; row 1: 7 + 4
    cu = torch.tensor(offsets, dtype=torch.int32)
    out = _torch_varlen(fake_varlen(gqa_native, causal_as), module, q, k, v, cu, 7, 0.3)
    torch.testing.assert_close(out, block_diagonal_reference(q, k, v, offsets, scale=0.3), **TOL)


def test_the_collators_give_the_boundaries_and_the_attention_reads_them():
    """cu_seq_lens from PaddingFreeCollator and PackedCollator cut exactly where the position ids restart (pad
    documents included); the attention given them and no position ids equals the block-diagonal reference, and
    offsets that cross a row are refused."""
    from sft.data.batches.packing import PaddingFreeCollator
    from sft.model.attention import packed_attention_forward

    convs = docs()
    rows = [{"input_ids": sum(pair, []), "labels": sum(pair, []),
             "position_ids": [p for c in pair for p in range(len(c))]}
            for pair in (convs[:2], convs[3:])]  # 13 + 9 tokens; 5 tokens and then a pad document of 17
    packed = PackedCollator(PAD)(rows)
    bounds = document_bounds(packed["position_ids"], 2)
    assert bounds == [[(0, 13), (13, 22)], [(0, 5), (5, 22)]]
    flat = [0, 13, 22, 27, 44]
    assert packed["cu_seq_lens_q"].dtype == torch.int32 and packed["cu_seq_lens_q"].tolist() == flat
    assert torch.equal(packed["cu_seq_lens_k"], packed["cu_seq_lens_q"]) and packed["max_length_q"] == 17
    free = PaddingFreeCollator()([{"input_ids": c, "labels": c} for c in convs])
    assert free["cu_seq_lens_q"].tolist() == [0, 13, 22, 39, 44] and free["max_length_q"] == 17
    assert document_bounds(free["position_ids"], 1) == [[(0, 13), (13, 22), (22, 39), (39, 44)]]

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 22, 8), torch.randn(2, 2, 22, 8), torch.randn(2, 2, 22, 8)
    out, _ = packed_attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=packed["cu_seq_lens_q"],
                                      max_length_q=packed["max_length_q"])
    torch.testing.assert_close(out, block_diagonal_reference(q, k, v, flat), **TOL)
    with pytest.raises(ValueError, match="whole documents"):
        crossing = torch.tensor([0, 30, 44], dtype=torch.int32)  # a "document" across the two rows
        packed_attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=crossing, max_length_q=30)
