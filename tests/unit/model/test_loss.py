"""The LM head and loss at supervised positions only (sft/model/loss.py) equal transformers' full computation.

fp32 throughout; tolerance: losses relative 1e-5, gradients relative 1e-5 with an absolute floor of 1e-7 (the
per-row products and the loss sum run in another order than over the whole [batch, seq, vocab] logits).
"""
import pytest
import torch
import transformers

from sft.model.loss import MAX_LOGIT_ELEMENTS, compute_supervised_loss, supports_supervised_head

RTOL, ATOL = 1e-5, 1e-7


def tiny(tied: bool, vocab: int = 512, model_type: str = "qwen2", seed: int = 0):
    torch.manual_seed(seed)
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[model_type]
    cfg = cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=tied, initializer_range=0.1)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def batch(vocab: int, seed: int = 1):
    """Two rows of 24 tokens, the second padded by 5; supervised spans in the middle of each (labels -100 elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 24), generator=g)
    labels = torch.full_like(ids, -100)
    labels[0, 6:15], labels[1, 3:9], labels[1, 12:19] = ids[0, 6:15], ids[1, 3:9], ids[1, 12:19]
    mask = torch.ones_like(ids)
    mask[1, 19:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(model, inputs, num_items, max_logit_elements=MAX_LOGIT_ELEMENTS):
    full = loss_and_grads(model, lambda: model(**inputs, num_items_in_batch=num_items, use_cache=False).loss)
    ours = loss_and_grads(model, lambda: compute_supervised_loss(model, inputs, num_items,
                                                                 model.get_output_embeddings(), max_logit_elements))
    assert ours[0].item() == pytest.approx(full[0].item(), rel=RTOL)
    assert ours[1].keys() == full[1].keys() and ours[1]
    for name, g in full[1].items():
        torch.testing.assert_close(ours[1][name], g, rtol=RTOL, atol=ATOL, msg=name)
    return full[1]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("num_items", [None, 37])
def test_full_fine_tuning_equal_loss_and_gradients(tied, num_items):
    model = tiny(tied)
    grads = assert_same(model, batch(512), torch.tensor(num_items) if num_items else None)
    assert grads["lm_head.weight" if not tied else "model.embed_tokens.weight"].abs().sum() > 0


def test_chunked_with_recomputation_equal_to_one_chunk():
    """A chunk of 5 positions (5 x 512 logits): 5 chunks, each recomputed in backward; still the full result."""
    assert_same(tiny(tied=False), batch(512), torch.tensor(22), max_logit_elements=5 * 512)


def test_lora_equal_loss_and_gradients_with_adapter_on_the_head():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny(tied=False, model_type="llama"), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"],
        init_lora_weights=False))  # non-zero B: every adapter gets a gradient
    assert supports_supervised_head(model)
    grads = assert_same(model, batch(512), torch.tensor(22), max_logit_elements=7 * 512)
    assert any("lm_head" in n for n in grads) and all(not n.endswith("base_layer.weight") for n in grads)


def test_real_qwen_vocabulary_tied_model_equal(tiny_model_dir):
    """The test asset: Qwen2, 151,646-token vocabulary, tied embeddings."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and supports_supervised_head(model)
    assert_same(model, batch(model.config.vocab_size), torch.tensor(22))


def test_batch_without_supervised_target_gives_zero_loss_and_zero_gradients():
    model = tiny(tied=False)
    inputs = batch(512)
    inputs["labels"][:] = -100
    loss, grads = loss_and_grads(model, lambda: compute_supervised_loss(model, inputs, torch.tensor(8),
                                                                        model.get_output_embeddings()))
    assert loss.item() == 0 and all(g.abs().sum() == 0 for g in grads.values())


def test_collator_shift_labels_are_used_as_given():
    model = tiny(tied=False)
    inputs = batch(512)
    shift = torch.nn.functional.pad(inputs["labels"][:, 1:], (0, 1), value=-100)
    shift[0, 8] = -100  # differs from labels[..., 1:]: only shift_labels can say so
    given = {**inputs, "shift_labels": shift}
    full = model(**{k: v for k, v in inputs.items() if k != "labels"}, labels=inputs["labels"], shift_labels=shift,
                 num_items_in_batch=torch.tensor(20)).loss
    ours = compute_supervised_loss(model, given, torch.tensor(20), model.get_output_embeddings())
    assert ours.item() == pytest.approx(full.item(), rel=RTOL)


def test_models_with_a_processed_head_keep_the_full_path():
    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    assert cfg.final_logit_softcapping  # logits = tanh(logits / c) * c after the head
    assert not supports_supervised_head(transformers.AutoModelForCausalLM.from_config(cfg))


def test_packed_row_with_restarting_position_ids_equal():
    """A padding-free packed row (transformers' DataCollatorWithFlattening: position_ids restart per conversation,
    no attention_mask): the model's inputs pass through unchanged. The reference runs without a KV cache: with
    transformers 5.24's default use_cache=True the packed conversations attend to each other (another loss)."""
    model = tiny(tied=True, vocab=512)
    b = batch(512)
    features = [{"input_ids": b["input_ids"][i].tolist(), "labels": b["labels"][i].tolist()} for i in range(2)]
    packed = transformers.DataCollatorWithFlattening(return_tensors="pt")(features)
    assert "position_ids" in packed and "attention_mask" not in packed
    assert_same(model, dict(packed), torch.tensor(21))


def test_trainer_step_in_bf16_with_fp32_lora_adapters_equals_the_full_head(tmp_path):
    """--bf16 on CPU (the README example with --bf16 auto): bf16 base weights, fp32 LoRA adapters (peft's default),
    accelerate's autocast around the model's forward. The head, run outside that forward, must be under the same
    autocast: the first step's loss equals the full head's within bf16 rounding (relative 2e-2)."""
    import datasets
    import peft

    from sft.train.trainer import Trainer

    inputs = batch(512)
    rows = datasets.Dataset.from_dict({k: v.tolist() for k, v in inputs.items()})
    losses = {}
    for supervised in (True, False):
        model = peft.get_peft_model(tiny(tied=True).to(torch.bfloat16),
                                    peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        assert next(p for n, p in model.named_parameters() if "lora_A" in n).dtype == torch.float32
        args = transformers.TrainingArguments(str(tmp_path / str(supervised)), bf16=True, use_cpu=True, max_steps=1,
                                              per_device_train_batch_size=2, learning_rate=1e-3, report_to=[],
                                              logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=rows, supervised_head=supervised,
                          data_collator=lambda feats: {k: torch.tensor([f[k] for f in feats]) for k in feats[0]})
        assert trainer.supervised_head is supervised
        trainer.train()
        losses[supervised] = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)
