"""The one place that uses the interpreter's private exit steps (checked against CPython 3.11.7).

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
