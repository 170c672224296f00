"""Test worker for sequence parallelism (run in one process, or under torchrun; the repository root on PYTHONPATH):
trains through sft.app.train's ``trainer_for`` as finetune.py does, and records, for comparison between
``--sequence_parallel_size`` 1 and N, every optimizer step's loss and gradient norm and the trained weights.

Report folder: ``$SFT_TEST_REPORT_DIR``: ``rank{N}.json`` (losses, grad norms, the rank's micro batch tokens, the
attention in use) and, from rank 0, ``weights.pt`` (trainable parameters; full tensors under FSDP2).
"""
import json
import os
import sys

from sft.compat.bitsandbytes import keep_out_unless_needed

keep_out_unless_needed(sys.argv[1:])  # before peft is imported, as finetune.py does (sft.cli.train_command)

import torch  # noqa: E402

from sft.app.train import trainer_for  # noqa: E402
from sft.cli import exit_process  # noqa: E402
from sft.config.arguments import parse_args  # noqa: E402
from sft.distributed.process_group import finish_process_group  # noqa: E402
from sft.logs import setup_logging  # noqa: E402


def main():
    setup_logging()
    record(sys.argv[1:], os.environ["SFT_TEST_REPORT_DIR"])
    finish_process_group()


def record(argv: list, report_dir: str) -> None:
    """Train with the flags ``argv`` and write the report into ``report_dir``; one process (N = 1) calls it in the
    test's own process (tests/integration/distributed/test_sequence_parallel.py: no interpreter and imports of its
    own), each rank under torchrun through :func:`main`."""
    trainer, tok, eot = trainer_for(*parse_args(argv))
    shapes = []
    collate = trainer.data_collator

    def recording_collator(features):
        batch = collate(features)
        shapes.append(int(batch["input_ids"].shape[1]))
        return batch

    trainer.data_collator = recording_collator
    trainer.train()
    weights = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: a collective, every rank calls it
            weights[name.replace("module.", "")] = t.detach().float().cpu().clone()
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        torch.save(weights, os.path.join(report_dir, "weights.pt"))
    log = trainer.state.log_history
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    config = getattr(base, "config", None) or trainer.model.module.config
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "losses": [h["loss"] for h in log if "loss" in h],
                   "grad_norms": [h["grad_norm"] for h in log if "grad_norm" in h], "row_tokens": shapes,
                   "attention": str(getattr(config, "_attn_implementation", "?")),
                   "eval_loss": [h["eval_loss"] for h in log if "eval_loss" in h]}, f)


if __name__ == "__main__":
    exit_process(main() or 0)  # as finetune.py ends
