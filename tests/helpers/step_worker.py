"""Test worker run under torchrun in place of finetune.py (tests/integration/train/test_world_size_resume.py; the
repository root on PYTHONPATH, see tests.helpers.paths.pythonpath_env): trains through :func:`sft.cli.train_main`
(parse, validate, resume choice, the world-size change, train, save) with the Trainer's collator wrapped to record,
in order, which samples this rank consumed (sha1 of each sample's ``input_ids``).

Report: ``$SFT_TEST_REPORT_DIR/rank{N}.json``: ``first_step`` (the optimizer step its first sample was fetched for),
``seen`` (samples in the order fetched; accelerate's loader fetches one micro batch ahead, so the caller cuts it
into steps of micro batch x gradient accumulation samples and drops what is left over), ``grad_accum`` (the
accumulation the run trained with), ``losses`` (every logged training loss, from the checkpoint's history on).
"""
import hashlib
import json
import os
import sys

from sft.compat.bitsandbytes import keep_out_unless_needed

keep_out_unless_needed(sys.argv[1:])  # before peft is imported, as finetune.py does (sft.cli.train_command)

import sft.app.train as training  # noqa: E402
from sft.cli import exit_process, train_main  # noqa: E402


def main() -> int:
    report_dir = os.environ["SFT_TEST_REPORT_DIR"]
    build, got = training.build_trainer, {}

    def recording_build_trainer(*args, **kwargs):
        trainer, tok, eot = build(*args, **kwargs)
        collate, seen = trainer.data_collator, got.setdefault("seen", [])

        def recording_collator(features):
            got.setdefault("first_step", trainer.state.global_step + 1)
            seen.extend(hashlib.sha1(json.dumps(f["input_ids"]).encode()).hexdigest() for f in features)
            return collate(features)

        trainer.data_collator = recording_collator
        got["trainer"] = trainer
        return trainer, tok, eot

    training.build_trainer = recording_build_trainer  # run() looks it up in sft.app.train when it runs
    code = train_main(sys.argv[1:])
    trainer = got.get("trainer")
    if trainer is not None:
        with open(os.path.join(report_dir, f"rank{trainer.args.process_index}.json"), "w") as f:
            json.dump({"first_step": got.get("first_step"), "seen": got.get("seen", []),
                       "grad_accum": trainer.args.gradient_accumulation_steps,
                       "losses": {x["step"]: x["loss"] for x in trainer.state.log_history if "loss" in x}}, f)
    return code


if __name__ == "__main__":
    exit_process(main())  # as finetune.py ends
