"""``--bf16 auto``: bfloat16 where the machine computes it fast, float32 elsewhere.

On CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and later). On CPU: the ``avx512_bf16`` or ``amx_bf16``
instruction-set flag in ``/proc/cpuinfo`` (native bf16 dot products) and a measured probe that a bf16 matmul
is at least as fast as fp32 (:func:`matmul_probe`, ~10 ms): machines of one kind with the flag have been seen
to run bf16 at 1-2 GFLOP/s against ~160 in fp32. Under several processes the choice is agreed (bf16 only if
every rank chose it), so one job never mixes precisions. The training log shows the choice, its reason and the
measured matmul peak of the dtype used (:mod:`sft.train.metrics`).
"""
from __future__ import annotations

from typing import Optional, Union

from sft.distributed.collectives import all_ranks, backend

FAST_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
TRUE, FALSE = ("true", "1", "yes", "y", "t"), ("false", "0", "no", "n", "f")


def parse_bf16(value: Union[str, bool]) -> Union[bool, str]:
    """``--bf16``'s value: True / False (as transformers' ``string_to_bool`` spells them), ``"auto"``, or the text
    unchanged (reported by :func:`sft.app.validation.validate`)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in TRUE else False if text in FALSE else "auto" if text == "auto" else str(value)


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's ``flags`` in ``path`` (empty when the file is missing or has none, e.g. not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def auto_bf16(cuda: Optional[bool] = None, cpuinfo: str = "/proc/cpuinfo") -> tuple[bool, str]:
    """``(use bf16, why)`` for ``--bf16 auto``: on CUDA (``cuda`` None: ``torch.cuda.is_available()``) whether the
    GPU supports bf16, on CPU whether a fast-bf16 flag (:data:`FAST_BF16_CPU_FLAGS`) is present."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        ok = torch.cuda.is_bf16_supported()
        return ok, f"GPU {'supports' if ok else 'does not support'} bf16"
    found = sorted(cpu_flags(cpuinfo) & set(FAST_BF16_CPU_FLAGS))
    if not found:
        return False, f"CPU has none of {', '.join(FAST_BF16_CPU_FLAGS)} (bf16 would be emulated)"
    fp32, bf16 = matmul_probe()
    measured = f"{PROBE_N}x{PROBE_N} matmul: bf16 {bf16 / 1e9:.0f}, fp32 {fp32 / 1e9:.0f} GFLOP/s"
    if bf16 < fp32:
        return False, f"CPU has {', '.join(found)} but bf16 is slower than fp32 here ({measured})"
    return True, f"CPU has {', '.join(found)}; {measured}"


PROBE_N = 512


def matmul_probe(n: int = PROBE_N, repeats: int = 5) -> tuple[float, float]:
    """``(fp32, bf16)`` FLOP/s of the best of ``repeats`` square ``n x n`` CPU matmuls in each dtype (2 n^3 FLOPs
    each), the two dtypes timed in turn so that other processes' load falls on both alike, and the best of several
    filtering it out. A bf16 product slower than 20 fp32 ones ends the bf16 timing (emulated bf16: up to ~0.3 s at
    n=512). The operands come from a generator of its own (the global RNG is left alone)."""
    import time

    import torch

    gen = torch.Generator().manual_seed(0)
    pairs = {dt: (torch.randn(n, n, generator=gen).to(dt), torch.randn(n, n, generator=gen).to(dt))
             for dt in (torch.float32, torch.bfloat16)}
    best = {dt: float("inf") for dt in pairs}
    for dt, (a, b) in pairs.items():
        torch.matmul(a, b)  # warm-up (kernel selection)
    for _ in range(repeats):
        for dt, (a, b) in pairs.items():
            if dt == torch.bfloat16 and best[dt] != float("inf") and best[dt] > 20 * best[torch.float32]:
                continue
            t0 = time.perf_counter()
            torch.matmul(a, b)
            best[dt] = min(best[dt], time.perf_counter() - t0)
    return 2 * n ** 3 / best[torch.float32], 2 * n ** 3 / best[torch.bfloat16]


def agree_across_ranks(use: bool) -> bool:
    """Under an initialised gloo process group: True only if every rank has ``use`` True (an all-reduce MIN of one
    integer on the CPU, :func:`sft.distributed.collectives.all_ranks`); otherwise ``use``."""
    if backend() != "gloo":
        return use
    return all_ranks(use)


def resolve_bf16(requested: Union[bool, str], fp16: bool) -> tuple[bool, Optional[str]]:
    """``(bf16, reason)`` for this process from ``--bf16`` as parsed (:func:`parse_bf16`), while parsing (no process
    group yet): True / False as given; ``auto`` decided by :func:`auto_bf16` (False when ``fp16``: ``--fp16 True``
    given), the reason saying why; any other text False (reported by :func:`sft.app.validation.validate`). Every
    rank agrees on an ``auto`` choice once the runtime has started: :func:`agreed_bf16`."""
    if requested == "auto":
        return (False, FP16_GIVEN) if fp16 else auto_bf16()
    return (requested if isinstance(requested, bool) else False), None


FP16_GIVEN = "--fp16 True given"


def agreed_bf16(bf16: bool, requested: Union[bool, str], reason: Optional[str]) -> tuple[bool, Optional[str]]:
    """``(bf16, reason)`` every rank uses, from this process's choice ``bf16`` (:func:`resolve_bf16`), ``--bf16`` as
    parsed (``requested``) and the choice's ``reason``: under ``auto`` (not overridden by ``--fp16``), bf16 only
    where every rank chose it (:func:`agree_across_ranks`; a collective under gloo: call it on every rank at the same
    point, after the process group exists), the reason then saying so; otherwise ``bf16`` and ``reason``."""
    bf16 = bool(bf16)
    if requested == "auto" and reason != FP16_GIVEN:
        agreed = agree_across_ranks(bf16)  # every rank takes part, whatever it chose
        if bf16 and not agreed:
            return False, f"{reason}; another rank chose fp32"
    return bf16, reason
