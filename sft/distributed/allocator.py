"""The host memory allocator of the training processes (stdlib only: ``finetune/launch.sh`` reads it through
``python -m sft.distributed plan``, before torch is imported anywhere).

On CPU a training step allocates and frees the same large blocks at every step (activations, gradients, the
logits: tens of MiB each at 2,048 tokens). glibc's malloc gives such blocks back to the kernel when they are freed
and faults their pages in again at the next step; tcmalloc keeps them. Measured in docs/benchmarks.md ("The
allocator"): 1.25x to 1.36x real tokens/s at 2,048 tokens in fp32, no change at 512; jemalloc with its default
settings was slower (0.63x), so it is not chosen. PyTorch's own CPU launcher preloads tcmalloc the same way
(``python -m torch.backends.xeon.run_cpu --enable_tcmalloc``, which sets ``LD_PRELOAD``).

``SFT_ALLOCATOR`` chooses:

* ``auto`` (the default): tcmalloc when the device is the CPU and the library is found, else the C library's malloc;
* ``tcmalloc``: tcmalloc, an error when it is not found;
* ``glibc``: nothing preloaded.

A ``LD_PRELOAD`` that already names an allocator (an entry named libtcmalloc*, libjemalloc*, libmimalloc*) is kept as
the user gave it, also over ``SFT_ALLOCATOR=tcmalloc`` (the start line says so). A library file the loader would
refuse (not a shared library, another architecture, a path with a space or colon) is never chosen.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Mapping

from sft.errors import ContractError

CHOICES = ("auto", "tcmalloc", "glibc")
# gperftools' library names: the minimal build (Debian/Ubuntu libtcmalloc-minimal4, RHEL gperftools-libs) first
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
        "/usr/local/lib64")
# gperftools prints "tcmalloc: large alloc N bytes ..." on stderr for every allocation above this (default 1 GiB),
# e.g. each weight shard a large model loads: raised so that the console stays the training's
QUIET_THRESHOLD = str(1 << 40)


def _elf_header(path: str) -> tuple[bytes, int] | None:
    """``(class, byte order and machine bytes, e_type)`` of the ELF file ``path``, or None when it is not one
    that can be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return head[4:6] + head[18:20], int.from_bytes(head[16:18], "little" if head[5] == 1 else "big")


def _preload_problem(path: str) -> str | None:
    """Why the dynamic loader would not preload ``path`` into this interpreter's processes, or None."""
    if any(c in path for c in " \t\n:"):
        return "its path holds a space or a colon, which LD_PRELOAD cannot carry"
    header = _elf_header(path)
    if header is None or header[1] != 3:  # ET_DYN
        return "not a shared library"
    own = _elf_header(os.path.realpath(sys.executable))
    if own is not None and header[0] != own[0]:
        return "built for another architecture than this Python"
    return None


def find_tcmalloc(env: Mapping[str, str], rejected: list[str] | None = None) -> str | None:
    """The absolute path of a gperftools tcmalloc shared library this interpreter can preload, or None: looked for
    under ``$CONDA_PREFIX/lib``, the folders of ``LD_LIBRARY_PATH`` and the usual system library folders (Debian's
    multiarch ones included). A file with the right name that the loader would refuse (not a shared library,
    another architecture, a path with a space or colon) is skipped; ``rejected`` collects why."""
    dirs = [os.path.join(env["CONDA_PREFIX"], "lib")] if env.get("CONDA_PREFIX") else []
    dirs += [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d] + list(DIRS)
    for d in dirs:
        for name in NAMES:
            path = os.path.abspath(os.path.join(d, name))
            if not os.path.isfile(path):
                continue
            problem = _preload_problem(path)
            if problem is None:
                return path
            if rejected is not None:
                rejected.append(f"{path}: {problem}")
    return None


def preloaded_allocator(preload: str) -> str | None:
    """The allocator an ``LD_PRELOAD`` value already names (an entry whose file name starts with libtcmalloc,
    libjemalloc or libmimalloc), or None."""
    for entry in re.split(r"[:\s]+", preload):
        m = re.match(r"lib(tcmalloc|jemalloc|mimalloc)", os.path.basename(entry))
        if m:
            return m.group(1)
    return None


def choose_allocator(env: Mapping[str, str], device: str) -> tuple[str, dict[str, str]]:
    """The allocator for the training processes. Returns ``(description for the start line, variables to
    export)``; the variables are ``LD_PRELOAD`` (the library first, then what the user had) and
    ``TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD`` (unless the user set it), or nothing.

    Raises:
        ContractError: ``SFT_ALLOCATOR`` is not one of :data:`CHOICES`, or is ``tcmalloc`` and no library is found.
    """
    choice = env.get("SFT_ALLOCATOR", "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ContractError([f"SFT_ALLOCATOR={env['SFT_ALLOCATOR']}: expected one of {', '.join(CHOICES)} "
                             "(auto: tcmalloc on CPU when installed; glibc: the C library's malloc); for jemalloc or "
                             "mimalloc put the library in LD_PRELOAD: it is kept as given"])
    preload = env.get("LD_PRELOAD", "")
    given = preloaded_allocator(preload)
    if given:
        ignored = "; SFT_ALLOCATOR=tcmalloc not applied" if choice == "tcmalloc" and given != "tcmalloc" else ""
        return f"{given} (LD_PRELOAD as given{ignored})", _quiet(env) if given == "tcmalloc" else {}
    if choice == "glibc" or (choice == "auto" and device != "cpu"):
        return "glibc malloc" + (" (SFT_ALLOCATOR=glibc)" if choice == "glibc" else ""), {}
    rejected: list[str] = []
    path = find_tcmalloc(env, rejected)
    if path is None:
        skipped = f"; skipped: {'; '.join(rejected)}" if rejected else ""
        if choice == "tcmalloc":
            raise ContractError(["SFT_ALLOCATOR=tcmalloc: no tcmalloc library found that this Python can preload "
                                 f"(looked for {NAMES[0]} in $CONDA_PREFIX/lib, LD_LIBRARY_PATH and "
                                 f"{', '.join(DIRS[:3])}, ...{skipped}); install it (Debian/Ubuntu: apt-get install "
                                 "libtcmalloc-minimal4; RHEL: dnf install gperftools-libs) or set SFT_ALLOCATOR=auto"])
        return f"glibc malloc (no tcmalloc found{skipped}: apt-get install libtcmalloc-minimal4 is faster on CPU)", {}
    return f"tcmalloc ({path})", {"LD_PRELOAD": f"{path}:{preload}" if preload else path, **_quiet(env)}


def _quiet(env: Mapping[str, str]) -> dict[str, str]:
    """tcmalloc's large-alloc report threshold, unless the user set one."""
    return {} if "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD" in env else \
        {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": QUIET_THRESHOLD}
