"""File-system helpers, the one home of each (standard library only): hashing a file, flushing a file or a folder
to disk, writing a file atomically, reading a JSON file.

Durability order of :func:`atomic_write`: the bytes go to a temporary file in the destination's folder, which is
flushed and fsynced, then renamed over the destination (``os.replace``: a reader sees the old file or the whole new
one, never part of one), then, when asked, the folder is fsynced so that the rename itself survives a crash.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import Any, Optional, Union

CHUNK = 1 << 20  # bytes per read when hashing (1 MiB)


def hash_file(path: str, hasher, chunk: int = CHUNK):
    """Feed the bytes of file ``path`` to ``hasher`` (anything with ``update(bytes)``: ``hashlib.sha256()``,
    ``xxhash.xxh3_128()``), ``chunk`` bytes per read, so memory does not grow with the file. Returns ``hasher``.

    Raises:
        OSError: the file cannot be opened or read (IsADirectoryError for a folder).
    """
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            hasher.update(block)
    return hasher


def file_sha256(path: str) -> str:
    """Hex sha256 (64 lowercase hex digits) of the file ``path``'s bytes; for a folder (a ``datasets``
    ``save_to_disk`` folder), of every regular file directly inside it, in name order, each as its name, a NUL byte
    and its bytes, all in one digest (sub-folders are not read). Used in data cache keys and the cross-node input
    fingerprints.

    Raises:
        OSError: ``path`` or one of its files cannot be read (FileNotFoundError when missing).
    """
    h = hashlib.sha256()
    if not os.path.isdir(path):
        return hash_file(path, h).hexdigest()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            h.update(name.encode() + b"\0")
            hash_file(full, h)
    return h.hexdigest()


def _fsync(path: str, flags: int, ignore_errors: bool) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    except OSError:
        if not ignore_errors:
            raise
    finally:
        os.close(fd)


def fsync_file(path: str, ignore_errors: bool = False) -> None:
    """Flush file ``path``'s data to its disk (``fsync``, whoever wrote it).

    Raises:
        OSError: the file cannot be opened; or ``fsync`` fails, unless ``ignore_errors``.
    """
    _fsync(path, 0, ignore_errors)


def fsync_dir(path: str) -> None:
    """Flush folder ``path``'s entries (files created, renamed or removed in it) to its disk. An error of ``fsync``
    itself is ignored: some filesystems do not support it on a folder.

    Raises:
        OSError: the folder cannot be opened (missing, not a folder).
    """
    _fsync(path, getattr(os, "O_DIRECTORY", 0), True)


def atomic_write(path: str, data: Union[str, bytes], *, tmp: Optional[str] = None, sync_dir: bool = False) -> None:
    """Replace file ``path`` with ``data`` (bytes, or text written as UTF-8) atomically: write ``tmp``, flush and
    fsync it, ``os.replace`` it over ``path``, then fsync ``path``'s folder when ``sync_dir``.

    ``tmp``: the temporary file, in the same folder as ``path`` (a rename is atomic only within one filesystem);
    default ``PATH.tmp-HOST-PID``, unique among the processes of every node that shares the folder.

    Raises:
        OSError: the temporary file cannot be written or renamed (it is then left behind; ``path`` is unchanged).
    """
    if tmp is None:
        tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(os.path.dirname(path) or ".")


def atomic_write_json(path: str, value: Any, *, indent: Optional[int] = None, tmp: Optional[str] = None,
                      sync_dir: bool = False) -> None:
    """:func:`atomic_write` of ``json.dumps(value, indent=indent)`` (ASCII: non-ASCII characters escaped).

    Raises:
        TypeError: ``value`` is not JSON-serializable (nothing is written then).
        OSError: as :func:`atomic_write`.
    """
    atomic_write(path, json.dumps(value, indent=indent), tmp=tmp, sync_dir=sync_dir)


def read_json(path: str) -> Any:
    """The JSON value in file ``path`` (UTF-8), as ``json.load`` gives it (any JSON type).

    Raises:
        FileNotFoundError: no such file.
        OSError: it cannot be read.
        ValueError: it is not valid JSON (``json.JSONDecodeError``) or not UTF-8 (``UnicodeDecodeError``).
    """
    with open(path, encoding="utf-8") as f:
        return json.load(f)
