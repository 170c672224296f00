"""torchrun worker for tests/test_distributed.py: trains through sft.training like finetune.py, and
records which samples this rank saw and a digest of its final weights.

Usage: torchrun ... tests/dist_worker.py REPORT_DIR [finetune.py flags ...]
"""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sft.arguments import parse_args, validate  # noqa: E402
from sft.logs import setup_logging
from sft.training import build_trainer, save  # noqa: E402


def main():
    report_dir, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    validate(*args)
    setup_logging()
    trainer, tok, eot = build_trainer(*args)
    seen = []
    collate = trainer.data_collator

    def recording_collator(features):
        seen.extend(hashlib.sha1(json.dumps(f["input_ids"]).encode()).hexdigest() for f in features)
        return collate(features)

    trainer.data_collator = recording_collator
    trainer.train()
    save(trainer, tok, eot, args[2].output_dir)
    h = hashlib.sha256()
    for name, p in sorted(trainer.model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    rank = int(os.environ["RANK"])
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": args[2].world_size, "seen": seen, "digest": h.hexdigest(),
                   "losses": [x["loss"] for x in trainer.state.log_history if "loss" in x]}, f)


if __name__ == "__main__":
    main()
