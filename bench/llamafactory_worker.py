#!/usr/bin/env python
"""One LLaMA-Factory training run for bench/compare.py, measured as compare.py measures ours (a benchmark).

    .venv-llamafactory/bin/python bench/llamafactory_worker.py --config RUN.yaml.json --json RESULT.json

Runs in LLaMA-Factory's own virtual environment (``bash bench/setup_llamafactory.sh``) and never imports
``sft``. ``--config`` is a JSON file of LLaMA-Factory's training arguments (compare_peers.llamafactory_config);
the run goes through LLaMA-Factory's own entry (``llamafactory.train.tuner.run_exp``) with one extra callback
that times every optimizer step (on_step_begin -> on_step_end) and a forward pre-hook on the model that counts
each micro batch's tokens: real = non-pad positions (``attention_mask != 0`` for a 2-D mask of document
indices; for neat_packing's 4-D float mask [batch, 1, seq, seq], the positions whose diagonal entry is 0,
i.e. that may attend to themselves), total = all positions, supervised = ``labels != -100``. Step 1 is
warm-up and left out. Writes JSON with the same keys as compare.py's workers; peak RSS is this process's.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time


def counts(kwargs) -> tuple[int, int, int]:
    """(real, total, supervised) positions of one forward's keyword arguments (module docstring)."""
    ids, mask, labels = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("labels")
    if mask is None:
        real = ids.numel()
    elif mask.dim() == 2:
        real = int((mask != 0).sum())
    else:  # [batch, 1, seq, seq] additive mask: 0 where attention is allowed
        real = int((mask[:, 0].diagonal(dim1=-2, dim2=-1) == 0).sum())
    sup = int((labels != -100).sum()) if labels is not None else 0
    return real, ids.numel(), sup


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="JSON file of LLaMA-Factory training arguments")
    p.add_argument("--json", required=True, help="where to write the result")
    p.add_argument("--timing", choices=("epoch", "steps"), default="steps", help="epoch: time epoch 2 only (the "
                   "config trains two epochs); steps: every optimizer step but the first")
    a = p.parse_args(argv)
    import torch
    from llamafactory.train.tuner import run_exp
    from transformers import TrainerCallback

    config = json.load(open(a.config, encoding="utf-8"))
    steps, pending = [], [0, 0, 0]
    state = {"epoch": 0}

    def hook(module, args, kwargs):
        if module.training and kwargs.get("input_ids") is not None:
            for i, n in enumerate(counts(kwargs)):
                pending[i] += n

    class Measure(TrainerCallback):
        def on_train_begin(self, args, st, control, model=None, **kw):
            model.register_forward_pre_hook(hook, with_kwargs=True)
            frozen = trainable = 0
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    n = m.in_features * m.out_features
                    trainable, frozen = (trainable + n, frozen) if m.weight.requires_grad else (trainable, frozen + n)
            head = model.get_output_embeddings()
            state["flops_per_token"] = 4 * frozen + 6 * trainable
            state["head_flops_per_token"] = 4 * head.in_features * head.out_features  # frozen head
            state["attn"] = model.config._attn_implementation
            state["batch"] = args.per_device_train_batch_size

        def on_epoch_begin(self, args, st, control, **kw):
            state["epoch"] += 1

        def on_step_begin(self, args, st, control, **kw):
            pending[:] = [0, 0, 0]
            state["t"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            steps.append((time.perf_counter() - state["t"], *pending, state["epoch"]))

    run_exp(config, callbacks=[Measure()])
    # the warm-up left out: epoch 1 (--timing epoch), or step 1
    timed = [s for s in steps if s[4] == 2] if a.timing == "epoch" else steps[1:]
    if not timed:
        print(f"llamafactory_worker: nothing to time ({len(steps)} optimizer step(s), --timing {a.timing})",
              file=sys.stderr)
        return 1
    t = [s[0] for s in timed]
    real, total, sup = (sum(s[i] for s in timed) for i in (1, 2, 3))
    result = {"system": "llamafactory", "rank": 0, "world": 1, "steps": len(t), "real": real, "total": total,
              "supervised": sup, "seconds": sum(t), "median_step_s": statistics.median(t),
              "peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
              "threads": torch.get_num_threads(), "callback_tokens_per_s": real / sum(t), **state}
    result.pop("t", None)
    result.pop("epoch", None)
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
