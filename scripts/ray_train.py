#!/usr/bin/env python
"""Launch finetune.py's training on a Ray cluster with Ray Train (TorchTrainer), once, from any node (= sft-ray).

    python scripts/ray_train.py --num_workers 2 --placement_strategy SPREAD \
        --model_name_or_path MODEL_DIR --data_path data.jsonl --output_dir /shared/out --use_lora True

Ray flags (--ray_address, --num_workers, --use_gpu, --cpus_per_worker, --gpus_per_worker,
--placement_strategy, --placement_timeout) plus every finetune.py flag; `-h` lists the Ray ones.
Exit codes as finetune.py: 0 done, 2 a problem you can fix, 75 preempted (same command resumes).
Details: sft/ray/driver.py and docs/ray.md.
"""
import os
import sys

# this checkout's sft, as finetune.py (next to it) gets: the scripts work without installing the package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sft.cli import ray_main  # noqa: E402  (stdlib only; a missing dependency is reported by the CLI policy)

if __name__ == "__main__":
    sys.exit(ray_main())
