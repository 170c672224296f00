"""Host memory as the memory plan counts it on CPU: what this process's cgroup still lets it take (v1 or v2), the
model's weights paged in before the resident set is read, and freed heap given back to the system.

A batch scheduler or a container caps a job's memory with a cgroup (SLURM's ``task/cgroup`` with ``--mem``, a
Kubernetes pod's limit, ``docker run --memory``, ``systemd-run -p MemoryMax=``), and the kernel kills a process of
that cgroup when it needs more than the limit, whatever ``MemAvailable`` says. The limit is on the process's own
cgroup or any cgroup above it, so it is read where ``/proc/self/cgroup`` places the process, not at the hierarchy's
root.

What counts as used is the kernel's usage less the page cache it can drop first (``inactive_file``), the "working
set" as the kubelet and ``docker stats`` compute it (Kubernetes docs, "Node-pressure Eviction"; cgroup v2:
``memory.current``, ``memory.max``, ``memory.stat``, Documentation/admin-guide/cgroup-v2.rst; v1:
``memory.usage_in_bytes``, ``memory.limit_in_bytes``, ``memory.stat``'s ``total_inactive_file``,
Documentation/admin-guide/cgroup-v1/memory.rst).

Weights loaded from safetensors stay memory-mapped from the file until first read (transformers' loading), so the
resident set after loading does not hold them yet; the first step reads them all. glibc's ``malloc`` keeps memory
freed by earlier work (the probe's forward pass, DDP's parameter broadcast) in its heap instead of returning it to the
system, so without :func:`trim_heap` the resident set carries it into training and a step's peak depends on what ran
before it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Optional

import torch

UNLIMITED = 2 ** 60  # v1 writes "no limit" as 2^63 rounded down to a page; v2 as "max"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(folder: str, key: str) -> int:
    text = _read(os.path.join(folder, "memory.stat")) or ""
    return next((int(v) for k, v in (ln.split()[:2] for ln in text.splitlines() if len(ln.split()) >= 2)
                 if k == key), 0)


def _mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str, str, str]]:
    """``(root inside the hierarchy, mount point, file system type, super options)`` of each cgroup mount."""
    out = []
    for line in (_read(mountinfo) or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4], tail[0], tail[2]))
    return out


def _folders(path: str, root: str, mount: str) -> list[str]:
    """The folders of ``path`` (a cgroup as ``/proc/self/cgroup`` names it) and of every cgroup above it that this
    mount shows, deepest first."""
    rel = path
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        rel = path[len(root.rstrip("/")):]
    elif root != "/":  # a cgroup namespace: the mount's root is the process's own cgroup
        rel = "/"
    folders, parts = [], [p for p in rel.split("/") if p]
    for n in range(len(parts), -1, -1):
        folder = os.path.join(mount, *parts[:n])
        if os.path.isdir(folder):
            folders.append(folder)
    return folders


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup",
                mountinfo: str = "/proc/self/mountinfo") -> Optional[tuple[int, int]]:
    """``(free, limit)`` in bytes of the memory cgroup (this process's, or one above it) that leaves the least room:
    ``free = limit - (usage - inactive file pages)``, never below 0. None where no cgroup with a memory limit is found
    (none set, no cgroup file system, not Linux). The usage counts only pages charged to the cgroup: file pages another
    cgroup read first (a model file cached before the job started) are resident in the process but not in it, so the
    limit itself also bounds what the process may hold."""
    lines = [ln.split(":", 2) for ln in (_read(proc_cgroup) or "").splitlines() if ln.count(":") >= 2]
    rooms: list[tuple[int, int]] = []
    for root, mount, fstype, options in _mounts(mountinfo):
        if fstype == "cgroup2":
            path = next((p for h, c, p in lines if h == "0" and c == ""), None)
            limit_file, usage_file, inactive = "memory.max", "memory.current", "inactive_file"
        elif "memory" in options.split(","):
            path = next((p for _h, c, p in lines if "memory" in c.split(",")), None)
            limit_file, usage_file, inactive = "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        else:
            continue
        if path is None:
            continue
        for folder in _folders(path, root, mount):
            limit, usage = _read(os.path.join(folder, limit_file)), _read(os.path.join(folder, usage_file))
            if not limit or not usage or limit == "max" or not limit.isdigit() or not usage.isdigit():
                continue
            if int(limit) >= UNLIMITED:
                continue
            rooms.append((max(0, int(limit) - max(0, int(usage) - _stat(folder, inactive))), int(limit)))
    return min(rooms) if rooms else None


def page_in(model) -> int:
    """Read one element of every memory page of ``model``'s CPU parameters and buffers, so that weights still mapped
    from their checkpoint file become resident (counted by ``VmRSS`` and by the cgroup) before the plan reads the
    resident set. Returns the bytes of CPU tensors read (others are skipped: CUDA, meta, ZeRO-3 placeholders)."""
    total, seen = 0, set()
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            flat = t.detach().reshape(-1)
            step = max(1, 4096 // max(1, t.element_size()))
            _ = flat[::step].sum() if flat.is_floating_point() else flat[::step].to(torch.int64).sum()
            total += t.untyped_storage().nbytes()
    return total


_LIBC = None


def trim_heap() -> bool:
    """Give the heap's free memory back to the system (glibc ``malloc_trim(0)``, malloc_trim(3)). Returns False where
    there is no glibc (the call is then a no-op)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return False
    _LIBC.malloc_trim(0)
    return True
