"""The allocator finetune/launch.sh gives the training processes (sft/distributed/allocator.py): tcmalloc on CPU
when installed, what the user preloaded kept, SFT_ALLOCATOR's choices and errors, and the preload reaching the
training processes for real, with one process and under torchrun."""
import _ctypes
import os
import shutil
import subprocess
import sys

import pytest

from sft.distributed import allocator
from sft.distributed.allocator import QUIET_THRESHOLD, choose_allocator, find_tcmalloc
from sft.errors import ContractError
from tests.helpers.launchers import without_check
from tests.helpers.paths import ROOT

LAUNCH = os.path.join(ROOT, "finetune", "launch.sh")


SHARED_OBJECT = _ctypes.__file__  # a real shared library of this Python's architecture (a C extension)


def _lib(folder, name="libtcmalloc_minimal.so.4", data=None):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    if data is None:
        shutil.copyfile(SHARED_OBJECT, path)
    else:
        with open(path, "wb") as f:
            f.write(data)
    return path


@pytest.fixture
def fake_lib(tmp_path):
    """A folder on LD_LIBRARY_PATH holding a loadable shared library named like gperftools' (found first: the
    folders of LD_LIBRARY_PATH come before the system's)."""
    _lib(tmp_path)
    return str(tmp_path)


def test_auto_on_cpu_preloads_tcmalloc_and_quiets_its_large_alloc_reports(fake_lib):
    what, exports = choose_allocator({"LD_LIBRARY_PATH": f"/nonexistent:{fake_lib}"}, "cpu")
    path = os.path.join(fake_lib, "libtcmalloc_minimal.so.4")
    assert what == f"tcmalloc ({path})"
    assert exports == {"LD_PRELOAD": path, "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": QUIET_THRESHOLD}


def test_the_users_preload_and_threshold_are_kept(fake_lib):
    path = os.path.join(fake_lib, "libtcmalloc_minimal.so.4")
    env = {"LD_LIBRARY_PATH": fake_lib, "LD_PRELOAD": "/opt/libprofiler.so",
           "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}
    assert choose_allocator(env, "cpu")[1] == {"LD_PRELOAD": f"{path}:/opt/libprofiler.so"}


@pytest.mark.parametrize("given", ["/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/x/libmimalloc.so",
                                   "/a/libz.so /opt/libjemalloc.so.2"])
def test_an_allocator_already_preloaded_is_left_alone_and_said(fake_lib, given):
    what, exports = choose_allocator({"LD_LIBRARY_PATH": fake_lib, "LD_PRELOAD": given}, "cpu")
    assert exports == {} and what.endswith("(LD_PRELOAD as given)")
    what, exports = choose_allocator({"LD_LIBRARY_PATH": fake_lib, "LD_PRELOAD": given, "SFT_ALLOCATOR": "tcmalloc"},
                                     "cpu")
    assert exports == {} and what.endswith("(LD_PRELOAD as given; SFT_ALLOCATOR=tcmalloc not applied)")


def test_a_users_tcmalloc_gets_the_quiet_threshold(fake_lib):
    assert choose_allocator({"LD_PRELOAD": "/opt/libtcmalloc.so.4"}, "cpu") == (
        "tcmalloc (LD_PRELOAD as given)", {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": QUIET_THRESHOLD})


@pytest.mark.parametrize("preload", ["/tmp/tcmalloc-tools/libz.so.1", "/home/mimalloc_user/libfoo.so"])
def test_an_allocators_name_in_a_folder_is_not_an_allocator(fake_lib, preload):
    """Found by breaking it: a substring test took these for tcmalloc and mimalloc and preloaded nothing."""
    what, exports = choose_allocator({"LD_LIBRARY_PATH": fake_lib, "LD_PRELOAD": preload}, "cpu")
    assert what.startswith("tcmalloc (") and exports["LD_PRELOAD"].endswith(f":{preload}")


def _wrong_machine() -> bytes:
    data = bytearray(open(SHARED_OBJECT, "rb").read())
    data[18:20] = (183 if data[18:20] != b"\xb7\x00" else 62).to_bytes(2, "little")  # aarch64, or x86-64 on aarch64
    return bytes(data)


@pytest.mark.parametrize("name,folder,data,why", [
    ("text", "notso", b"not a library", "not a shared library"),
    ("other architecture", "arm", None, "built for another architecture than this Python"),
    ("space in path", "sp ace", b"", "its path holds a space or a colon"),
    ("colon in path", "col:on/lib", b"", "its path holds a space or a colon"),  # through CONDA_PREFIX
])
def test_a_library_the_loader_would_refuse_is_never_chosen(tmp_path, monkeypatch, name, folder, data, why):
    """Found by breaking it: each was named on the start line while the loader refused it ("cannot be preloaded:
    ignored") and the ranks ran under glibc."""
    monkeypatch.setattr(allocator, "DIRS", ())
    if name == "other architecture":
        data = _wrong_machine()
    _lib(tmp_path / folder, data=data if data != b"" else None)
    env = ({"CONDA_PREFIX": str(tmp_path / "col:on")} if ":" in folder else {"LD_LIBRARY_PATH": str(tmp_path / folder)})
    what, exports = choose_allocator(env, "cpu")
    assert exports == {} and what.startswith("glibc malloc (no tcmalloc found; skipped: ") and why in what
    with pytest.raises(ContractError, match=f"SFT_ALLOCATOR=tcmalloc: no tcmalloc library found that this Python "
                                            f"can preload .*{why}"):
        choose_allocator({**env, "SFT_ALLOCATOR": "tcmalloc"}, "cpu")
    good = _lib(tmp_path / "good")  # a loadable one further along LD_LIBRARY_PATH is still found
    env["LD_LIBRARY_PATH"] = f"{env.get('LD_LIBRARY_PATH', '')}:{tmp_path / 'good'}"
    assert choose_allocator(env, "cpu")[1]["LD_PRELOAD"] == good


def test_a_relative_library_folder_gives_an_absolute_preload(tmp_path, monkeypatch):
    monkeypatch.setattr(allocator, "DIRS", ())
    _lib(tmp_path / "rel" / "lib")
    monkeypatch.chdir(tmp_path)
    assert choose_allocator({"LD_LIBRARY_PATH": "rel/lib"}, "cpu")[1]["LD_PRELOAD"] == \
        str(tmp_path / "rel" / "lib" / "libtcmalloc_minimal.so.4")


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
    _lib(tmp_path / "lib", "libtcmalloc.so.4")
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
    """The real launcher (without its flag and data check: the training processes come after it,
    tests/helpers/launchers.py), with a program that reports the libraries mapped into each training process."""
    program = tmp_path / "maps.py"
    program.write_text("import os\nrank = os.environ.get('RANK', '0')\n"
                       "libs = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'malloc' in l})\n"
                       f"open(os.path.join({str(tmp_path)!r}, 'rank' + rank), 'w').write(' '.join(libs))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SFT_ALLOCATOR")}
    # MASTER_PORT: the worker's (tests/conftest.py)
    env.update(SFT_PROGRAM=str(program), NPROC_PER_NODE=nproc, SFT_PREFLIGHT="0", PYTHON=without_check(tmp_path))
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
