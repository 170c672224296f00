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

A ``LD_PRELOAD`` that already names an allocator (tcmalloc, jemalloc, mimalloc) is kept as the user gave it.
"""
from __future__ import annotations

import os
from typing import Mapping

from ..errors import ContractError

CHOICES = ("auto", "tcmalloc", "glibc")
# gperftools' library names: the minimal build (Debian/Ubuntu libtcmalloc-minimal4, RHEL gperftools-libs) first
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
        "/usr/local/lib64")
ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
# gperftools prints "tcmalloc: large alloc N bytes ..." on stderr for every allocation above this (default 1 GiB),
# e.g. each weight shard a large model loads: raised so that the console stays the training's
QUIET_THRESHOLD = str(1 << 40)


def find_tcmalloc(env: Mapping[str, str]) -> str | None:
    """The path of gperftools' tcmalloc shared library, or None: looked for under ``$CONDA_PREFIX/lib``, the
    folders of ``LD_LIBRARY_PATH`` and the usual system library folders (Debian's multiarch ones included)."""
    dirs = [os.path.join(env["CONDA_PREFIX"], "lib")] if env.get("CONDA_PREFIX") else []
    dirs += [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d] + list(DIRS)
    for d in dirs:
        for name in NAMES:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
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
                             "(auto: tcmalloc on CPU when installed; glibc: the C library's malloc)"])
    preload = env.get("LD_PRELOAD", "")
    given = next((a for a in ALLOCATORS if a in preload), None)
    if given:
        return f"{given} (LD_PRELOAD as given)", {}
    if choice == "glibc" or (choice == "auto" and device != "cpu"):
        return "glibc malloc" + (" (SFT_ALLOCATOR=glibc)" if choice == "glibc" else ""), {}
    path = find_tcmalloc(env)
    if path is None:
        if choice == "tcmalloc":
            raise ContractError(["SFT_ALLOCATOR=tcmalloc: no tcmalloc library found (looked for "
                                 f"{NAMES[0]} in $CONDA_PREFIX/lib, LD_LIBRARY_PATH and {', '.join(DIRS[:3])}, ...); "
                                 "install it (Debian/Ubuntu: apt-get install libtcmalloc-minimal4; RHEL: dnf install "
                                 "gperftools-libs) or set SFT_ALLOCATOR=auto"])
        return "glibc malloc (no tcmalloc found: apt-get install libtcmalloc-minimal4 is faster on CPU)", {}
    exports = {"LD_PRELOAD": f"{path}:{preload}" if preload else path}
    if "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD" not in env:
        exports["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] = QUIET_THRESHOLD
    return f"tcmalloc ({path})", exports
