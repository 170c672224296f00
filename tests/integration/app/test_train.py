"""End to end on CPU: tiny random Qwen2ForCausalLM with the real Qwen vocabulary."""
import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from sft.app.train import save, trainer_for
from sft.config.arguments import parse_args
from tests.helpers import assets
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT


def train(model_dir, data, out, *extra):
    args = parse_args(["--model_name_or_path", model_dir, "--data_path", data, "--output_dir", str(out),
                       "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--seed", "0",
                       "--disable_tqdm", "True", *extra])
    trainer, tok, eot = trainer_for(*args)
    trainer.train()
    save(trainer, tok, eot, str(out))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, tok, losses


def logits(model, tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def base_weights(model):
    return {k.replace("base_model.model.", "").replace(".base_layer", ""): v.detach().clone()
            for k, v in model.state_dict().items() if "lora_" not in k}


def test_lora_trains_saves_and_reloads(tiny_model_dir, toy_data, tmp_path):
    out = tmp_path / "out"
    trainer, tok, losses = train(tiny_model_dir, toy_data, out, "--use_lora", "True", "--lora_r", "8",
                                 "--lora_alpha", "32", "--learning_rate", "1e-1", "--max_steps", "12",
                                 "--per_device_train_batch_size", "4", "--lora_dropout", "0.0")
    assert len(losses) == 12 and all(map(lambda x: x == x, losses))  # no NaN
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    model = trainer.model
    # base weights frozen, adapter changed
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    trained = base_weights(model)
    for k, v in original.items():
        if k in trained:
            assert torch.equal(trained[k], v), k
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # initialised at zero, so training moved them
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    # saved adapter reloads and reproduces the logits
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "chat_template.jinja",
            "generation_config.json"} <= set(os.listdir(out))
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    saved_tok = AutoTokenizer.from_pretrained(out)
    assert saved_tok.chat_template and saved_tok.pad_token_id != 151645
    torch.testing.assert_close(logits(reloaded, saved_tok), logits(model, tok), rtol=1e-5, atol=1e-5)
    gen = GenerationConfig.from_pretrained(out)
    assert 151645 in gen.eos_token_id  # <|im_end|> stops generation


def test_full_finetune_saves_safetensors_that_reload(tiny_model_dir, toy_data, tmp_path):
    out = tmp_path / "full"
    trainer, tok, losses = train(tiny_model_dir, toy_data, out, "--learning_rate", "1e-3", "--max_steps", "3",
                                 "--per_device_train_batch_size", "4")
    assert "model.safetensors" in os.listdir(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(reloaded, tok), logits(trainer.model, tok), rtol=1e-5, atol=1e-5)
    assert 151645 in reloaded.generation_config.eos_token_id


def test_new_chat_tokens_train_embeddings(toy_data, tmp_path):
    base = assets.tiny_qwen2_dir(zero_chat_rows=True)
    out = tmp_path / "emb"
    trainer, tok, _ = train(base, toy_data, out, "--use_lora", "True", "--lora_r", "4", "--max_steps", "2",
                            "--learning_rate", "1e-2", "--per_device_train_batch_size", "4")
    cfg = json.load(open(out / "adapter_config.json"))
    # tied embeddings: peft keeps lm_head tied to the trained embed_tokens copy (ensure_weight_tying)
    assert "embed_tokens" in cfg["modules_to_save"] and cfg["ensure_weight_tying"] is True
    emb = trainer.model.get_input_embeddings().weight
    assert emb[151645].abs().max() > 0  # <|im_end|>'s row was zero and is now trained
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out))
    torch.testing.assert_close(logits(reloaded, tok), logits(trainer.model, tok), rtol=1e-5, atol=1e-5)


def test_checkpointing_lazy_and_grouping_together(tiny_model_dir, toy_data, tmp_path):
    _, _, losses = train(tiny_model_dir, toy_data, tmp_path / "o", "--use_lora", "True", "--lora_r", "4",
                         "--max_steps", "2", "--gradient_checkpointing", "True", "--lazy_preprocess", "True",
                         "--group_by_length", "True", "--per_device_train_batch_size", "2")
    assert len(losses) == 2 and all(0 < x < 100 for x in losses)


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=ROOT, timeout=300)


def test_cli_malformed_record_short_error_no_traceback(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [TOY[0], {"id": "broken-7", "conversations": [
        {"from": "user", "value": "hi"}, {"from": "robot", "value": "beep"}]}])
    out = tmp_path / "out"
    r = run_cli("--model_name_or_path", tiny_model_dir, "--data_path", data, "--output_dir", str(out))
    assert r.returncode == 2
    assert "id='broken-7'" in r.stderr and "turn 1" in r.stderr and "unknown role 'robot'" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()  # nothing written


def test_cli_refuses_nonempty_output_dir(tiny_model_dir, toy_data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    r = run_cli("--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir", str(out))
    assert r.returncode == 2 and "--overwrite_output_dir" in r.stderr and "Traceback" not in r.stderr
    assert (out / "precious.txt").read_text() == "keep me"
