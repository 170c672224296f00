"""sft: supervised fine-tuning of chat LLMs (full, LoRA) on top of transformers.Trainer.

Data flows one way: file -> records -> rendered conversation -> (input_ids, labels) -> batch -> Trainer.
"""
__version__ = "0.1.0"

from sft.logs import hold_import_notices  # noqa: E402  (stdlib only; before any submodule imports transformers/peft)

hold_import_notices()
