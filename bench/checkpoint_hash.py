#!/usr/bin/env python
"""What the checksums in a checkpoint's completion marker cost (a benchmark, not a test).

Builds a full-fine-tuning checkpoint of the example model's size (SmolLM2-135M: its real fp32
model.safetensors, an optimizer.pt of Adam's two fp32 moments per weight, i.e. twice the model's bytes, as
written by torch.save of random tensors, and the tokenizer files) in a temporary folder, then times, on the
warm page cache right after writing (what a save sees):

* writing the checkpoint (torch.save + copying the model), the part a save always pays;
* fsync of every file (paid before checksums too);
* XXH3-128 of every file (sft.train.integrity.file_digest, what a save adds) and, for comparison, SHA-256;
* sft.train.checkpoint.mark_complete + sft.train.checkpoint.verify (what a resume adds).

    .venv/bin/python bench/checkpoint_hash.py                  # the example model (scripts/prepare_example.py)
    .venv/bin/python bench/checkpoint_hash.py --model DIR --repeat 3

Prints one line per figure and the machine's load (``uptime``) before and after.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(HERE, ".cache", "example", "smollm2-135m-instruct")


def build(model: str, out: str) -> float:
    """Write the checkpoint into ``out``; returns seconds."""
    import torch
    from safetensors import safe_open

    t0 = time.perf_counter()
    for name in os.listdir(model):
        shutil.copy(os.path.join(model, name), os.path.join(out, name))
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    gen = torch.Generator().manual_seed(0)
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(s, generator=gen),
                 "exp_avg_sq": torch.rand(s, generator=gen)} for i, s in enumerate(shapes.values())}
    torch.save({"state": state, "param_groups": [{"lr": 1e-5, "params": list(state)}]},
               os.path.join(out, "optimizer.pt"))
    return time.perf_counter() - t0


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="a model folder with model.safetensors (default: the example's)")
    ap.add_argument("--repeat", type=int, default=2, help="times each hash is measured (the best is printed)")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temporary folder)")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.model, "model.safetensors")):
        print(f"{a.model}: no model.safetensors; run scripts/prepare_example.py or pass --model DIR", file=sys.stderr)
        return 2
    from sft.train import checkpoint as ck
    from sft.train.integrity import checkpoint_files, file_digest

    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    work = tempfile.mkdtemp(prefix="ckpt-hash-", dir=a.workdir)
    try:
        path = os.path.join(work, "checkpoint-10")
        os.makedirs(path)
        write_s = build(a.model, path)
        files = [os.path.join(path, rel) for rel in checkpoint_files(path, (ck.MARKER,))]
        size = sum(map(os.path.getsize, files))
        fsync_s = timed(lambda: [os.fsync(fd) or os.close(fd) for fd in (os.open(p, os.O_RDONLY) for p in files)])
        xxh = min(timed(lambda: [file_digest(p) for p in files]) for _ in range(a.repeat))

        def sha256(p):
            with open(p, "rb") as f:
                return hashlib.file_digest(f, "sha256").hexdigest()

        sha = min(timed(lambda: [sha256(p) for p in files]) for _ in range(a.repeat))
        mark_s = timed(lambda: ck.mark_complete(path, {}))
        verify_s = min(timed(lambda: ck.verify(path)) for _ in range(a.repeat))
        assert ck.verify(path) is None
        gb = size / 1e9
        print(f"checkpoint: {len(files)} files, {gb:.2f} GB ({a.model} full fine-tuning: weights fp32 + Adam moments)")
        print(f"write (torch.save + copy): {write_s:.2f} s; fsync of every file: {fsync_s:.2f} s")
        print(f"xxh3_128: {xxh:.2f} s ({gb / xxh:.2f} GB/s); sha256: {sha:.2f} s ({gb / sha:.2f} GB/s)")
        print(f"mark_complete (fsync + xxh3_128 + marker): {mark_s:.2f} s; verify on resume: {verify_s:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
