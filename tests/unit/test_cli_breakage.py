"""Inputs and faults found by breaking the CLI layer (sft.cli policy, sft.distributed, launch.sh, the wrappers):
each gives one paragraph naming what and the fix, a non-zero exit, no traceback, and leaves the user's files alone."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TOY, write_jsonl
from sft.cli import debug_enabled, generate_main, main, run_cli, train_main
from sft.errors import ConfigError, ContractError, SFTError

NO_HOST = ["..", "a" * 70 + ".com"]  # an empty label / one over 63 characters: socket raises UnicodeError


# ------------------------------------------------------------------------------------------ host names / contract

@pytest.mark.parametrize("name", NO_HOST)
def test_master_addr_that_is_no_host_name(name):
    from sft.distributed.contract import read_contract

    with pytest.raises(ContractError, match=f"MASTER_ADDR={name}: does not resolve on this node \\(not a valid host name"):
        read_contract({"NNODES": "2", "MASTER_ADDR": name})


@pytest.mark.parametrize("name", NO_HOST)
def test_ray_address_that_is_no_host_name(name):
    from sft.ray.driver import _gcs_unreachable

    assert "not a valid host name" in _gcs_unreachable(f"{name}:6379")


def test_plan_cli_reports_no_host_name_without_traceback():
    env = {**os.environ, "NNODES": "2", "MASTER_ADDR": ".."}
    r = subprocess.run([sys.executable, "-m", "sft.distributed", "plan"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2 and "error: MASTER_ADDR=..: does not resolve" in r.stderr and "Traceback" not in r.stderr


def test_one_node_several_processes_need_master_addr_on_this_host():
    # torchrun's processes would retry MASTER_ADDR for RDZV_TIMEOUT (600 s) with C++ stack traces
    from sft.distributed.contract import read_contract

    with pytest.raises(ContractError, match="MASTER_ADDR=192.0.2.7: not an address of this host"):
        read_contract({"NPROC_PER_NODE": "2", "MASTER_ADDR": "192.0.2.7"})
    with pytest.raises(ContractError, match="MASTER_ADDR=..: does not resolve.*leave MASTER_ADDR unset"):
        read_contract({"NPROC_PER_NODE": "2", "MASTER_ADDR": ".."})
    assert read_contract({"NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1"}).world_size == 2
    assert read_contract({"NPROC_PER_NODE": "1", "MASTER_ADDR": "192.0.2.7"}).world_size == 1  # unused by one process


# ------------------------------------------------------------------------------------------ flags and files

def test_config_that_cannot_be_read(tmp_path):
    from sft.arguments import parse_args

    with pytest.raises(ConfigError, match=r"--config /proc/self/mem: cannot be read \(Input/output error\)"):
        parse_args(["--config", "/proc/self/mem"])  # a regular file whose read fails, also for root
    with pytest.raises(ConfigError, match="not a file"):
        parse_args(["--config", str(tmp_path)])


def test_unconvertible_value_is_one_paragraph_not_the_whole_usage(capsys):
    rc = train_main(["--max_steps", "abc"])
    err = capsys.readouterr().err
    assert rc == 2 and "--max_steps/--max-steps: invalid int value: 'abc'" in err
    assert "usage:" not in err and len(err.splitlines()) <= 3, err
