"""``--bf16 auto``: bfloat16 where the machine computes it fast, float32 elsewhere.

On CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and later). On CPU: the ``avx512_bf16`` or ``amx_bf16``
instruction-set flag in ``/proc/cpuinfo`` (native bf16 dot products; without them PyTorch converts bf16 in
software and a bf16 matmul can run at a few GFLOP/s, far below fp32). The decision reads only these flags, so
every process of a job on the same kind of machine decides the same, and parsing stays free of measurements;
the training log shows the measured matmul peak of the dtype chosen (:mod:`sft.callbacks`).
"""
from __future__ import annotations

from typing import Optional, Union

FAST_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
TRUE, FALSE = ("true", "1", "yes", "y", "t"), ("false", "0", "no", "n", "f")


def parse_bf16(value: Union[str, bool]) -> Union[bool, str]:
    """``--bf16``'s value: True / False (as transformers' ``string_to_bool`` spells them), ``"auto"``, or the text
    unchanged (reported by :func:`sft.validation.validate`)."""
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
    if found:
        return True, f"CPU has {', '.join(found)}"
    return False, f"CPU has none of {', '.join(FAST_BF16_CPU_FLAGS)} (bf16 would be emulated): fp32"


def resolve_bf16_flag(args) -> None:
    """In ``TrainingArguments.__post_init__``: ``args.bf16`` from its parsed value (:func:`parse_bf16`); ``auto``
    decided by :func:`auto_bf16` (False when ``--fp16 True`` is given). Keeps ``args.bf16_requested`` (the value
    as given, reported by :func:`sft.validation.validate` when it is none of True / False / auto) and
    ``args.bf16_reason`` (why auto chose, else None)."""
    args.bf16_requested, args.bf16_reason = parse_bf16(args.bf16), None
    if args.bf16_requested == "auto":
        args.bf16, args.bf16_reason = (False, "--fp16 True given") if args.fp16 else auto_bf16()
    else:
        args.bf16 = args.bf16_requested if isinstance(args.bf16_requested, bool) else False
