"""How a training process ends (sft.cli.exit_process): after finish_process_group, without the interpreter's teardown,
but with everything sys.exit does before it (threading's exit callbacks and non-daemon threads, atexit handlers,
buffered output); otherwise sys.exit itself. One gloo process group of world size 1 in a subprocess each."""
import subprocess
import sys

import pytest

from tests.helpers.paths import pythonpath_env
from tests.helpers.ports import free_port

_PROGRAM = r"""
import atexit, concurrent.futures, os, sys, threading, time
import torch.distributed as dist
from sft.cli import exit_process
from sft.distributed.process_group import finish_process_group

out, port, finish = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "finish"


class AtTeardown:  # a module global: its __del__ runs in the interpreter's teardown only
    def __del__(self, _open=open, _path=os.path.join(out, "teardown")):  # builtins are gone by then
        _open(_path, "w").close()


keep = AtTeardown()
atexit.register(lambda: open(os.path.join(out, "atexit"), "w").close())
pool = concurrent.futures.ThreadPoolExecutor(1)  # an idle worker: threading's exit callback must release it
pool.submit(time.sleep, 0)


def late():
    time.sleep(0.5)
    open(os.path.join(out, "thread"), "w").close()


threading.Thread(target=late).start()  # non-daemon: sys.exit waits for it
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
if finish:
    finish_process_group()
sys.stdout.write("buffered, never flushed by the program")
exit_process(3)
"""


@pytest.mark.parametrize("finish", [True, False])
def test_exit_process_skips_only_the_teardown_after_a_finished_group(tmp_path, finish):
    r = subprocess.run([sys.executable, "-c", _PROGRAM, str(tmp_path), str(free_port()),
                        "finish" if finish else "no"], capture_output=True, text=True, timeout=120,
                       env=pythonpath_env())
    assert r.returncode == 3, r.stderr[-3000:]
    assert r.stdout == "buffered, never flushed by the program"
    made = sorted(p.name for p in tmp_path.iterdir())
    # the teardown (module globals' __del__) runs only on the sys.exit path
    assert made == (["atexit", "thread"] if finish else ["atexit", "teardown", "thread"]), (made, r.stderr[-3000:])
