"""sft.compat.bitsandbytes: which flags keep bitsandbytes in a training process (the rule), and that a process which
already imported peft keeps what it has. (That training works with it kept out: every integration test that trains
through finetune.py or a test worker runs that way; that 4-bit runs still get it: the Q-LoRA cells of
tests/integration/distributed/test_deepspeed.py.)"""
import json
import sys

import pytest

from sft.compat.bitsandbytes import keep_out_unless_needed, needs_bitsandbytes


@pytest.fixture
def folders(tmp_path):
    plain, quantized = tmp_path / "plain", tmp_path / "gptq"
    for folder, config in ((plain, {"model_type": "qwen2"}),
                           (quantized, {"model_type": "qwen2", "quantization_config": {"quant_method": "gptq"}})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    (tmp_path / "qlora.yaml").write_text("q_lora: true\n")
    (tmp_path / "plain.yaml").write_text("learning_rate: 1.0e-4\n")
    return tmp_path


@pytest.mark.parametrize("flags,needed", [
    (["--model_name_or_path", "{d}/plain", "--use_lora", "True"], False),
    (["--model_name_or_path={d}/plain", "--q_lora", "False", "--optim", "adamw_torch"], False),
    (["--model_name_or_path", "{d}/plain", "--config", "{d}/plain.yaml"], False),
    (["--model_name_or_path", "{d}/plain", "--config", "{d}/qlora.yaml", "--q_lora", "no"], False),  # the flag wins
    (["--model_name_or_path", "{d}/plain", "--q_lora", "True"], True),
    (["--model_name_or_path", "{d}/plain", "--q_lora"], True),  # a bare boolean flag is True
    (["--model_name_or_path", "{d}/plain", "--q_lora=1"], True),
    (["--model_name_or_path", "{d}/plain", "--q_lo", "yes"], True),  # argparse's abbreviation
    (["--model_name_or_path", "{d}/plain", "--optim", "paged_adamw_8bit"], True),
    (["--model_name_or_path", "{d}/plain", "--optim", "ademamix"], True),
    (["--model_name_or_path", "{d}/plain", "--config", "{d}/qlora.yaml"], True),
    (["--model_name_or_path", "{d}/plain", "--config", "{d}/missing.yaml"], True),
    (["--model_name_or_path", "{d}/gptq"], True),  # a pre-quantized base
    (["--model_name_or_path", "Qwen/Qwen2.5-7B-Instruct"], True),  # no local folder: its config is unknown here
    (["--model_name_or_path", "{d}/plain", "--optim"], True),  # a flag without its value: the parser will say
    ([], True),
])
def test_what_needs_bitsandbytes(folders, flags, needed):
    assert needs_bitsandbytes([f.format(d=folders) for f in flags]) is needed


def test_a_process_that_imported_peft_keeps_it(folders):
    import peft  # noqa: F401 - the test process has it, as a test or a notebook calling the entry would

    before = sys.modules.get("bitsandbytes")
    assert keep_out_unless_needed(["--model_name_or_path", str(folders / "plain")]) is False
    assert sys.modules.get("bitsandbytes") is before
