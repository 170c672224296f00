#!/usr/bin/env python
"""NCCL's flight recorder as sft turns it on, read back by torch's analyzer (CUDA only; run by bench/gpu_bench.py).

    .venv/bin/python -m torch.distributed.run --nproc_per_node 1 bench/flight_recorder_check.py OUT_DIR

Sets the recorder's variables as a training process does (:func:`sft.distributed.process_group.
flight_recorder_defaults`: ``TORCH_FR_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``, ``TORCH_FR_DUMP_TEMP_FILE`` =
``OUT_DIR/nccl_trace/rank_``), starts an NCCL group, runs 5 all-reduces, writes this rank's recorder dump where a
timeout would (torch's ``_dump_nccl_trace``, the function torch's own tests call), and runs the analyzer
(``python -m torch.distributed.flight_recorder.fr_trace OUT_DIR/nccl_trace -p rank_ -j``) on it. Prints the
number of recorded collectives and the analyzer's first lines; exit 0 when both worked, 1 otherwise, 2 without CUDA.
A benchmark-side check, not a test: it needs a GPU and NCCL, which the test machines lack.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(out: str) -> int:
    import torch
    import torch.distributed as dist

    from sft.distributed.process_group import flight_recorder_defaults

    if not torch.cuda.is_available():
        print("flight recorder: needs a CUDA GPU (NCCL); nothing run", file=sys.stderr)
        return 2
    flight_recorder_defaults(out)
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    x = torch.ones(1024, device=device)
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dump_fn = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump_fn is None:
        print("flight recorder: this torch build has no _dump_nccl_trace", file=sys.stderr)
        return 1
    raw = dump_fn()
    entries = pickle.loads(raw).get("entries", [])
    path = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]) + str(rank)
    with open(path, "wb") as f:
        f.write(raw)
    dist.destroy_process_group()
    print(f"flight recorder: {len(entries)} collective(s) recorded by rank {rank}, dump {path}")
    if rank != 0:
        return 0
    r = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                        os.path.dirname(path), "-p", "rank_", "-j"], capture_output=True, text=True, timeout=120)
    print("\n".join(("analyzer: " + line) for line in (r.stdout + r.stderr).splitlines()[:20]))
    return 0 if r.returncode == 0 and entries else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "flight-recorder-check"))
