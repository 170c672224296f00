"""The allocator finetune/launch.sh gives the training processes (sft/distributed/allocator.py): tcmalloc on CPU
when installed, what the user preloaded kept, SFT_ALLOCATOR's choices and errors, and the preload reaching the
training processes for real, with one process and under torchrun."""
import os
import subprocess
import sys

import pytest

from sft.distributed import allocator
from sft.distributed.allocator import QUIET_THRESHOLD, choose_allocator, find_tcmalloc
from sft.errors import ContractError
from tests.helpers.paths import ROOT

LAUNCH = os.path.join(ROOT, "finetune", "launch.sh")


@pytest.fixture
def fake_lib(tmp_path):
    """A folder on LD_LIBRARY_PATH holding a file named like gperftools' library (found first: the folders of
    LD_LIBRARY_PATH come before the system's)."""
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    return str(tmp_path)


def test_auto_on_cpu_preloads_tcmalloc_and_quiets_its_large_alloc_reports(fake_lib):
    what, exports = choose_allocator({"LD_LIBRARY_PATH": f"/nonexistent:{fake_lib}"}, "cpu")
    path = os.path.join(fake_lib, "libtcmalloc_minimal.so.4")
    assert what == f"tcmalloc ({path})"
    assert exports == {"LD_PRELOAD": path, "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": QUIET_THRESHOLD}


def test_the_users_preload_and_threshold_are_kept(fake_lib):
    path = os.path.join(fake_lib, "libtcmalloc_minimal.so.4")
    env = {"LD_LIBRARY_PATH": fake_lib, "LD_PRELOAD": "/opt/libprofiler.so", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}
    assert choose_allocator(env, "cpu")[1] == {"LD_PRELOAD": f"{path}:/opt/libprofiler.so"}


@pytest.mark.parametrize("given", ["/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/opt/libtcmalloc.so.4",
                                   "/x/libmimalloc.so"])
def test_an_allocator_already_preloaded_is_left_alone(fake_lib, given):
    what, exports = choose_allocator({"LD_LIBRARY_PATH": fake_lib, "LD_PRELOAD": given, "SFT_ALLOCATOR": "tcmalloc"}, "cpu")
    assert exports == {} and what.endswith("(LD_PRELOAD as given)")


def test_glibc_and_gpus_preload_nothing(fake_lib):
    assert choose_allocator({"LD_LIBRARY_PATH": fake_lib, "SFT_ALLOCATOR": "glibc"}, "cpu") == \
        ("glibc malloc (SFT_ALLOCATOR=glibc)", {})
    assert choose_allocator({"LD_LIBRARY_PATH": fake_lib}, "cuda") == ("glibc malloc", {})  # auto: CPU only
    assert choose_allocator({"LD_LIBRARY_PATH": fake_lib, "SFT_ALLOCATOR": "tcmalloc"}, "cuda")[1]["LD_PRELOAD"]


def test_missing_library(monkeypatch):
    monkeypatch.setattr(allocator, "DIRS", ())
    assert find_tcmalloc({}) is None
    what, exports = choose_allocator({}, "cpu")  # auto: a hint, never an error
    assert exports == {} and "apt-get install libtcmalloc-minimal4" in what
    with pytest.raises(ContractError, match="SFT_ALLOCATOR=tcmalloc: no tcmalloc library found.*apt-get install "
                                            "libtcmalloc-minimal4.*or set SFT_ALLOCATOR=auto"):
        choose_allocator({"SFT_ALLOCATOR": "tcmalloc"}, "cpu")


def test_conda_prefix_is_searched(tmp_path, monkeypatch):
    monkeypatch.setattr(allocator, "DIRS", ())
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc({"CONDA_PREFIX": str(tmp_path)}) == str(tmp_path / "lib" / "libtcmalloc.so.4")


def test_plan_rejects_an_unknown_choice_without_traceback():
    r = subprocess.run([sys.executable, "-m", "sft.distributed", "plan"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SFT_ALLOCATOR": "jemalloc"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "error: SFT_ALLOCATOR=jemalloc: expected one of auto, tcmalloc, glibc" in r.stderr


REAL = find_tcmalloc(os.environ)


@pytest.mark.skipif(REAL is None, reason="no tcmalloc on this machine (scripts/setup_env.sh installs it as root)")
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_launch_preloads_tcmalloc_into_every_training_process(tmp_path, nproc, tiny_model_dir, toy_data):
    """The real launcher (its flag and data check included), with a program that reports the libraries mapped
    into each training process."""
    program = tmp_path / "maps.py"
    program.write_text("import os\nrank = os.environ.get('RANK', '0')\n"
                       "libs = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'malloc' in l})\n"
                       f"open(os.path.join({str(tmp_path)!r}, 'rank' + rank), 'w').write(' '.join(libs))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SFT_ALLOCATOR")}
    env.update(SFT_PROGRAM=str(program), NPROC_PER_NODE=nproc, SFT_PREFLIGHT="0", MASTER_PORT="29731")
    argv = ["bash", LAUNCH, "-m", str(tiny_model_dir), "-d", str(toy_data), "--output_dir", str(tmp_path / "out")]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"allocator tcmalloc ({REAL})" in r.stderr
    for rank in range(int(nproc)):
        assert os.path.realpath(REAL) in {os.path.realpath(p) for p in (tmp_path / f"rank{rank}").read_text().split()}
    env["SFT_ALLOCATOR"] = "glibc"
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "allocator glibc malloc (SFT_ALLOCATOR=glibc)" in r.stderr
    assert (tmp_path / "rank0").read_text() == ""
