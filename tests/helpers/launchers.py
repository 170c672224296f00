"""Launching finetune/launch.sh (and the presets that call it) in tests without what a test does not prove."""
import os
import sys


def without_check(folder) -> str:
    """A ``PYTHON`` for finetune/launch.sh (and the presets) that answers ``python -m sft check`` with success at once
    and runs everything else with this interpreter. Written as ``folder/python-without-check``; returns its path.

    For the tests whose property comes after the launcher's check (what the training processes do: preemption,
    resume, the support matrix's cells, the rendezvous preflight, hangs, elastic rounds...), so that each launch does
    not start one more process that loads the tokenizer and encodes the data (8-9 s of CPU on the toy data, more on
    long records). The launches that still run the check end to end: the support matrix's ``lora-zero2`` cell
    (tests/integration/distributed/test_deepspeed.py), the SLURM and PBS jobs (tests/cluster/test_slurm.py), and the
    tests whose property is the check (test_cli_policy, test_bad_input, test_cli_breakage, test_example,
    test_quiet_console in tests/integration/app/)."""
    path = os.path.join(folder, "python-without-check")
    with open(path, "w") as f:
        f.write(f'#!/usr/bin/env bash\nif [[ "$1 $2 $3" == "-m sft check" ]]; then exit 0; fi\n'
                f'exec {sys.executable} "$@"\n')
    os.chmod(path, 0o755)
    return path
