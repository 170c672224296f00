"""A real training run (tiny Qwen2, LoRA, `python -m sft train`) with long conversations split at --model_max_length
64, an evaluation set held out by --eval_split_ratio, an evaluation before training, and the eval loss
before -> after printed at the end."""
import json
import os
import re
import subprocess
import sys

from sft.data.records.eval_split import in_eval, record_key
from sft.data.records.records import load_conversations
from tests.helpers.data import TOY, write_jsonl


def long_record(k):
    msgs = []
    for t in range(6):
        msgs += [{"role": "user", "content": f"Chat {k}, question {t}: what comes after {t}?"},
                 {"role": "assistant", "content": f"After {t} comes {t + 1}, and then {t + 2}."}]
    return {"id": f"long{k}", "messages": msgs}


def test_split_and_held_out_eval_train_with_loss_before_and_after(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", TOY + [long_record(k) for k in range(6)])
    convs = load_conversations(data)
    eval_convs = [c for c in convs if in_eval(record_key(c), 0.25, 0)]
    train_convs = [c for c in convs if not in_eval(record_key(c), 0.25, 0)]
    assert train_convs and eval_convs
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "sft", "train", "--model_name_or_path", tiny_model_dir,
                        "--data_path", data, "--output_dir", str(out), "--use_lora", "True", "--lora_r", "8",
                        "--lora_alpha", "32",
                        "--lora_dropout", "0", "--learning_rate", "1e-1", "--max_steps", "6",
                        "--per_device_train_batch_size", "4", "--model_max_length", "64", "--eval_split_ratio", "0.25",
                        "--eval_on_start", "True", "--report_to", "none", "--save_strategy", "no",
                        "--disable_tqdm", "True", "--logging_steps", "1", "--seed", "0"],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "SFT_PREFLIGHT": "0"})
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    n_long_train = sum(c.id.startswith("long") for c in train_convs)
    assert f"{n_long_train} of {len(train_convs)} conversations longer than --model_max_length 64 were split" in log
    m = re.search(r"eval loss (\d+\.\d+) \(before training\) -> (\d+\.\d+) \(after step 6\)", log)
    assert m, log[-3000:]
    before, after = map(float, m.groups())
    assert after < before - 0.1  # the held-out records are the same kind of text, so their loss falls
    state = json.loads((out / "trainer_state.json").read_text())
    evals = [h for h in state["log_history"] if "eval_loss" in h]
    assert evals[0]["step"] == 0 and abs(evals[0]["eval_loss"] - before) < 1e-3
