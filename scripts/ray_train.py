#!/usr/bin/env python
"""Launch finetune.py's training on a Ray cluster with Ray Train (TorchTrainer), once, from any node (= sft-ray).

    python scripts/ray_train.py --num_workers 2 --placement_strategy SPREAD \
        --model_name_or_path MODEL_DIR --data_path data.jsonl --output_dir /shared/out --use_lora True

Ray flags (--ray_address, --num_workers, --use_gpu, --cpus_per_worker, --gpus_per_worker,
--placement_strategy, --placement_timeout) plus every finetune.py flag; `-h` lists the Ray ones.
Exit codes as finetune.py: 0 done, 2 a problem you can fix, 75 preempted (same command resumes).
Details: sft/ray/driver.py and docs/ray.md.
"""
from _entry import run

if __name__ == "__main__":
    run("sft.ray.driver", "main", "sft-ray")
