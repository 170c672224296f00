"""Test worker run in place of finetune.py (``SFT_PROGRAM=tests/helpers/dist_worker.py`` for finetune/launch.sh
and the presets, or directly under torchrun; the repository root on PYTHONPATH, see
tests.helpers.paths.pythonpath_env): trains through sft.app.train exactly like finetune.py, then
records, per rank, which samples it saw, its losses and learning rates, what kind of run it was, and
(rank 0) the trained model's logits on a probe prompt, computed on every rank (ZeRO-3 and FSDP2 gather
weights layer by layer during the forward).

Report folder: ``$SFT_TEST_REPORT_DIR`` (``rank{N}.json``, ``logits.pt``).
"""
import hashlib
import json
import os
import sys

from sft.compat.bitsandbytes import keep_out_unless_needed

keep_out_unless_needed(sys.argv[1:])  # before peft is imported, as finetune.py does (sft.cli.train_command)

import torch  # noqa: E402

from sft.app.train import save, trainer_for  # noqa: E402
from sft.cli import exit_process  # noqa: E402
from sft.config.arguments import parse_args  # noqa: E402
from sft.distributed.process_group import finish_process_group  # noqa: E402
from sft.logs import setup_logging  # noqa: E402

PROBE = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n2+2 is 4.<|im_end|>\n"


def main():
    report_dir, argv = os.environ["SFT_TEST_REPORT_DIR"], sys.argv[1:]
    args = parse_args(argv)
    setup_logging()
    trainer, tok, eot = trainer_for(*args)
    seen = []
    collate = trainer.data_collator

    def recording_collator(features):
        seen.extend(hashlib.sha1(json.dumps(f["input_ids"]).encode()).hexdigest() for f in features)
        return collate(features)

    trainer.data_collator = recording_collator
    trainer.train()
    save(trainer, tok, eot, args[2].output_dir)
    model = trainer.model
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([tok(PROBE)["input_ids"]])
        logits = model(input_ids=ids).logits.float()
    fsdp2 = any(type(p).__name__ == "DTensor" for p in model.parameters())  # fully_shard's sharded parameters
    sharded = args[2].parsed.zero_stage == 3 or fsdp2
    h = hashlib.sha256()
    if not sharded:  # under ZeRO-3 and FSDP2 every rank holds a different shard
        for name, p in sorted(model.named_parameters()):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        torch.save(logits, os.path.join(report_dir, "logits.pt"))
    log = trainer.state.log_history
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": args[2].world_size, "seen": seen, "digest": h.hexdigest(),
                   "deepspeed": trainer.is_deepspeed_enabled, "zero_stage": args[2].parsed.zero_stage,
                   "linear_kinds": sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}),
                   "fsdp": trainer.is_fsdp_enabled, "fsdp2_sharded": fsdp2,
                   # layers transformers runs under activation checkpointing (its GradientCheckpointingLayer flag)
                   "checkpointed_layers": sum(getattr(m, "gradient_checkpointing", False) is True
                                              for m in model.modules()),
                   "losses": [x["loss"] for x in log if "loss" in x],
                   "grad_norms": [x.get("grad_norm") for x in log if "loss" in x],
                   # mixture of experts (sft/train/routing_health.py): this rank's experts with no token per step
                   "moe_idle_experts": [x.get("moe_idle_experts") for x in log if "loss" in x],
                   "zero3_leaf_blocks": sum(bool(getattr(m, "_z3_leaf", False)) for m in model.modules()),
                   "learning_rates": [x["learning_rate"] for x in log if "learning_rate" in x],
                   "max_steps": trainer.state.max_steps}, f)
    finish_process_group()  # as sft.cli.train_main ends


if __name__ == "__main__":
    exit_process(main() or 0)  # as finetune.py ends
