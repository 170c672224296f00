"""Per-conversation attention for packed rows (sft/attention.py) with the per-row packed collator (sft/packing.py):
each conversation's logits and gradients inside a packed micro batch equal those of the conversation alone, for
every attention implementation --packing offers, on two architectures (tiny Qwen2 with GQA, tiny Llama as SmolLM2),
in train and eval mode; padded batches keep their mask; the controls show the checks can fail.

Tolerance: fp32, rtol = atol = 1e-5 for logits, rtol 1e-4 / atol 1e-5 for gradients (summation order differs
between one forward per conversation and one packed forward; measured differences are ~1e-7)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from sft.attention import PACKED_ATTENTION, document_bounds, flash_varlen_available, packed_mask, use_packed_attention
from sft.chat import IGNORE_INDEX
from sft.packing import PackedCollator, check_packing_support

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
    not (torch.cuda.is_available() and flash_varlen_available()), reason="flash-attn varlen needs CUDA and flash-attn"))]


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
    batch = {k: v.to(device) for k, v in packed_batch(convs).items()}
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
    from sft.attention import packed_attention_forward

    module = torch.nn.Module()
    q = torch.randn(1, 2, 3, 8).repeat(1, 1, 2, 1)  # two equal halves
    with pytest.raises(ValueError, match="position_ids"):
        packed_attention_forward(module, q, q, q, None)
    out, _ = packed_attention_forward(module, q, q, q, None, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    torch.testing.assert_close(out[:, 3:], out[:, :3])  # two equal documents, each attending only to itself
    with pytest.raises(ValueError, match="sliding window"):
        packed_attention_forward(module, q, q, q, None, position_ids=torch.arange(6)[None], sliding_window=4)
