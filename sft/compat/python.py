"""The interpreter's knobs a command's process uses: its private exit steps (checked against CPython 3.11.7) and
the cyclic garbage collector paused while a command imports its libraries.

:func:`exit_skipping_teardown` ends a process the way ``sys.exit`` does up to the interpreter's teardown, then leaves
with ``os._exit``: ``threading._shutdown`` (the threading module's own exit callbacks, e.g. ``concurrent.futures``
telling its idle workers to leave, then a join of every non-daemon thread) and ``atexit._run_exitfuncs`` (every
``atexit`` handler, newest first: ``logging.shutdown``, ``multiprocessing``'s, a tracker's finish) are the two steps
``Py_FinalizeEx`` runs first, in that order (CPython ``Python/pylifecycle.c``: ``wait_for_thread_shutdown``, then
``_PyAtExit_Call``). What is skipped is what comes after them: the modules' teardown and C++ static destructors.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading


def exit_skipping_teardown(code: int):
    """Join the non-daemon threads and run the exit handlers as ``sys.exit`` would, flush stdout and stderr, then end
    the process with exit code ``code`` (an int, 0-255) without the interpreter's teardown. Never returns.

    Must run on the main thread (``threading._shutdown`` joins the others). Private API: ``threading._shutdown``,
    ``atexit._run_exitfuncs`` (CPython 3.11.7); where either is missing, this is ``sys.exit(code)``.
    """
    shutdown, run_exit_handlers = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exit_handlers is None or threading.current_thread() is not threading.main_thread():
        sys.exit(code)
    shutdown()
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block, on again after it (if it was on before).

    For the block of a command that imports its libraries (torch, transformers, peft, DeepSpeed): those imports
    allocate hundreds of thousands of objects that live as long as the process, and the collector, run every 700 net
    allocations (CPython's default threshold, ``gc.get_threshold()``), scans them again and again while they are
    being made; with it off, ``import sft.app.train`` took ~4% less CPU (9.07 s against 9.43 s, the means of six
    alternated pairs on a 2-core AMD EPYC; docs/testing.md). Nothing is lost: reference counting frees what is not in a
    cycle at once, and the first collection after the block finds the cycles made inside it. Raises nothing of its
    own; an exception of the block passes through, with the collector on again.
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
