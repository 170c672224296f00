"""What a failed test's processes said, in its report: one CI failure is enough to diagnose a multi-process test.

A pytest plugin (``pytest_plugins`` in tests/conftest.py); nothing to call in a test. When a test fails (setup, call
or teardown), its report gets a section with the last :data:`LINES` lines of:

* each process the test ran with captured output: every ``subprocess.run(..., capture_output=True)`` and
  ``Popen.communicate()`` during the test and its fixtures, with the command and exit code; the output a timeout
  cut short too (``subprocess.run(..., timeout=...)`` raising ``TimeoutExpired``);
* each log file (``*.log``, ``*.out``, ``*.err``) written while the test ran, under this process's pytest temporary
  folder (the test's ``tmp_path``, a fixture's ``tmp_path_factory`` folder: torchrun and training runs started
  with their output in a file, scripts/kill_resume_loop.py's run logs, cluster jobs' logs) or under a folder given
  to :func:`watch` (a cluster's daemon logs outside it).

Cheap: a passing test costs one reference per captured run, kept until the test ends; the files are looked for only
when a test fails. ``--show-capture=no`` hides the sections, as it hides pytest's captured output.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import time

import pytest

LINES = 40
MAX_PROCESSES = 12  # the last ones of a test that ran more
MAX_FILES = 12  # the most recently written ones
SUFFIXES = (".log", ".out", ".err")
_LINE_CHARS = 400  # a longer line (a progress bar redrawn with \r) is cut in the middle
_TITLE_CHARS = 110
_AGENT_ERROR = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"

_watched: list[str] = []
_runs: dict[int, dict] | None = None  # id(Popen) -> what it said, while a test runs
_started = 0.0
_communicate = subprocess.Popen.communicate


def watch(folder) -> None:
    """Also look in ``folder`` (for the rest of the session) for the log files a failed test shows: only those
    written while that test ran are shown."""
    _watched.append(os.fspath(folder))


def unwatch(folder) -> None:
    if os.fspath(folder) in _watched:
        _watched.remove(os.fspath(folder))


def tail(text: str | bytes | None, lines: int = LINES) -> str:
    """The last ``lines`` lines of ``text`` (bytes are decoded, undecodable bytes replaced), long lines cut, without
    torchrun's own traceback (its ``ChildFailedError``: some 20 lines of the launcher's frames that would push the
    failed worker's traceback above the last ``lines``; its summary of the failures is kept)."""
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    all_lines = text.splitlines()
    for i in [i for i, s in enumerate(all_lines) if s.startswith(_AGENT_ERROR)][::-1]:
        start = next((j for j in range(i, -1, -1) if all_lines[j].startswith("Traceback (most recent call last)")), i)
        all_lines[start:i + 1] = [f"[torchrun's own traceback ({i + 1 - start} lines) left out]"]
    last = all_lines[-lines:]
    half = _LINE_CHARS // 2
    return "\n".join(s if len(s) <= _LINE_CHARS else f"{s[:half]} [...] {s[-half:]}" for s in last)


def file_tail(path: str, lines: int = LINES) -> str:
    """The last ``lines`` lines of the file at ``path`` (reads at most its last 256 KiB)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 256 * 1024))
        return tail(f.read(), lines)


def _recording_communicate(self, input=None, timeout=None):
    try:
        out, err = _communicate(self, input, timeout)
    except subprocess.TimeoutExpired as e:
        _record(self, e.output, e.stderr, f"still running after {timeout} s")
        raise
    _record(self, out, err, None)
    return out, err


def _record(proc, out, err, timed_out) -> None:
    if _runs is not None and (out is not None or err is not None):
        _runs[id(proc)] = {"proc": proc, "stdout": out, "stderr": err, "timed_out": timed_out,
                           "order": _runs.get(id(proc), {}).get("order", len(_runs))}


def _short(text: str, limit: int, keep_end: bool = False) -> str:
    if len(text) <= limit:
        return text
    return "..." + text[3 - limit:] if keep_end else text[:limit - 3] + "..."


def _command(args) -> str:
    text = os.fsdecode(args) if isinstance(args, (str, bytes, os.PathLike)) else \
        " ".join(shlex.quote(os.fsdecode(a)) for a in args)
    return text.replace("\n", "\\n")  # one line: a section title


def _process_sections() -> list[tuple[str, str]]:
    runs = sorted((_runs or {}).values(), key=lambda r: r["order"])
    sections = []
    if len(runs) > MAX_PROCESSES:
        sections.append((f"{len(runs) - MAX_PROCESSES} earlier processes of this test not shown", ""))
    for r in runs[-MAX_PROCESSES:]:
        proc = r["proc"]
        how = r["timed_out"] or f"exit {proc.returncode}"
        for stream in ("stdout", "stderr"):
            if r[stream]:
                head = f"last {LINES} lines of {stream} ({how}): "
                sections.append((head + _short(_command(proc.args), _TITLE_CHARS - len(head)), tail(r[stream])))
    return sections


def _log_files(item) -> tuple[list[str], int]:
    roots = list(_watched)
    factory = getattr(item.config, "_tmp_path_factory", None)  # pytest's; each xdist worker has a folder of its own
    if factory is not None:
        try:
            roots.insert(0, str(factory.getbasetemp()))
        except OSError:
            pass
    found = {}
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                if name.endswith(SUFFIXES):
                    path = os.path.join(folder, name)
                    try:
                        mtime = os.stat(path).st_mtime
                    except OSError:
                        continue
                    if mtime >= _started:
                        found[os.path.realpath(path)] = mtime
    newest = sorted(found, key=found.get)
    return newest[-MAX_FILES:], max(0, len(newest) - MAX_FILES)


def _file_sections(item) -> list[tuple[str, str]]:
    paths, left_out = _log_files(item)
    sections = [(f"{left_out} older log files written during this test not shown", "")] if left_out else []
    for path in paths:
        try:
            text = file_tail(path)
        except OSError as e:
            text = f"(unreadable: {e})"
        head = f"last {LINES} lines of "
        sections.append((head + _short(path, _TITLE_CHARS - len(head), keep_end=True), text))
    return sections


def pytest_configure(config):
    subprocess.Popen.communicate = _recording_communicate


def pytest_unconfigure(config):
    subprocess.Popen.communicate = _communicate


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _runs, _started
    _runs, _started = {}, time.time()
    try:
        yield
    finally:
        _runs = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and not getattr(item, "_sft_tails_shown", False):
        item._sft_tails_shown = True  # once per test: a teardown that fails after a failed call adds no section
        rep.sections.extend(_process_sections() + _file_sections(item))
