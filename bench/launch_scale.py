#!/usr/bin/env python
"""The launch path past 3 hosts, on network-namespace hosts (a benchmark, not a test; needs root).

    PYTHONPATH=. .venv/bin/python bench/launch_scale.py --preflight 32   # contract + preflight hello on 32 hosts
    PYTHONPATH=. .venv/bin/python bench/launch_scale.py --elastic 8      # an elastic LoRA run on 8 hosts, one lost

(``PYTHONPATH=.``: it uses the namespace hosts of ``tests/helpers/netns.py``.)

``--preflight N``: every host runs what ``finetune/launch.sh`` runs before torchrun (``python -m
sft.distributed plan`` then ``python -m sft.distributed rendezvous``; stdlib only) with ``NNODES=N``; prints
the wall time until every node passed, the slowest node and the hello round itself (node rank 0's
rendezvous). ``--elastic N``: the real launcher with ``NNODES=N-1:N`` and the DDP LoRA preset on the tiny test
model (``SFT_TEST_ASSETS``); after the first complete checkpoint everything on host N-1 is killed; prints
the time to the first round, from the kill to the next round, and in all, and checks that the survivors
finished. Namespaces are those of ``tests/helpers/netns.py`` (private bridge, 10.213.0.0/24); they and every
process in them are removed at the end. Prints ``uptime`` before and after: figures carry the load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from tests.helpers import netns  # the namespace hosts of the cluster tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python") if os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")) \
    else sys.executable


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}, **{k: str(v) for k, v in kw.items()})
    return env


def preflight(n: int) -> None:
    hosts = netns.Hosts(n, tag="ls")
    try:
        script = f"{PY} -m sft.distributed plan >/dev/null && echo t1=$(date +%s.%N) && {PY} -m sft.distributed " \
                 "rendezvous && echo t2=$(date +%s.%N)"
        t0 = time.monotonic()
        procs = [subprocess.Popen(hosts.cmd(i, ["bash", "-c", script]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=_env(NNODES=n, NODE_RANK=i, MASTER_ADDR=hosts.addrs[0],
                                                      MASTER_PORT=6001, RDZV_TIMEOUT=120))
                 for i in range(n)]
        done, outs = [], []
        for p in procs:
            out, err = p.communicate(timeout=300)
            done.append(time.monotonic() - t0)
            outs.append((p.returncode, out, err))
        bad = [(i, rc, err.strip()[-300:]) for i, (rc, _, err) in enumerate(outs) if rc != 0]
        stamps = [dict(re.findall(r"(t[12])=([0-9.]+)", out)) for _, out, _ in outs]
        hello = float(stamps[0]["t2"]) - float(stamps[0]["t1"]) if {"t1", "t2"} <= stamps[0].keys() else float("nan")
        last_plan = max(float(s["t1"]) for s in stamps if "t1" in s) - min(float(s["t1"]) for s in stamps if "t1" in s)
        print(f"preflight on {n} namespace hosts: all passed: {not bad}; wall {max(done):.2f} s from start to the "
              f"last node; node rank 0's hello round {hello:.2f} s (from the end of its own contract check; the last "
              f"node's check ended {last_plan:.2f} s after the first: {n} python start-ups share this machine's cores)")
        for i, rc, err in bad:
            print(f"  node {i}: exit {rc}: {err}")
    finally:
        hosts.close()


def elastic(n: int, steps: int) -> None:
    model = next((os.path.join(r, d) for r in [os.environ.get("SFT_TEST_ASSETS", "")] if os.path.isdir(r)
                  for d in sorted(os.listdir(r)) if d.startswith("tiny-qwen2")), None)
    if model is None:
        sys.exit("set SFT_TEST_ASSETS to the test assets folder (tests/helpers/assets.py builds it)")
    from tests.helpers.data import TOY, write_jsonl

    tmp = tempfile.mkdtemp(prefix="sft-launch-scale-")
    data = write_jsonl(os.path.join(tmp, "toy.jsonl"), TOY)
    out = os.path.join(tmp, "out")
    preset = os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh")
    # global batch (n - 1) x n: kept at both world sizes (accumulation n - 1 at world size n, n at n - 1)
    flags = ["--output_dir", out, "--max_steps", str(steps), "--lora_r", "4", "--per_device_train_batch_size", "1",
             "--gradient_accumulation_steps", str(n - 1),
             "--save_strategy", "steps", "--save_steps", "4", "--disable_tqdm", "True", "--ddp_timeout", "60"]
    hosts = netns.Hosts(n, tag="le")
    logs = [open(os.path.join(tmp, f"node{i}.log"), "w+") for i in range(n)]
    procs = []
    try:
        t0 = time.monotonic()
        for i in range(n):
            env = _env(NNODES=f"{n - 1}:{n}", MASTER_ADDR=hosts.addrs[0], MASTER_PORT=6001, RDZV_TIMEOUT=300,
                       RDZV_ID="scale", MAX_RESTARTS=1)
            procs.append(subprocess.Popen(hosts.cmd(i, ["bash", preset, "-m", model, "-d", data, *flags]), env=env,
                                          stdout=logs[i], stderr=subprocess.STDOUT, start_new_session=True))

        def text(i):
            return open(logs[i].name, errors="replace").read()

        def wait(cond, limit=900):
            end = time.monotonic() + limit
            while not cond():
                if time.monotonic() > end or procs[0].poll() is not None:
                    raise SystemExit("gave up waiting; logs in " + tmp)
                time.sleep(0.3)

        wait(lambda: "round 0: this node" in text(0))
        first_round = time.monotonic() - t0
        wait(lambda: os.path.isdir(out) and any(os.path.isfile(os.path.join(out, d, "sft_checkpoint_complete.json"))
                                                 for d in os.listdir(out)))
        for pid in hosts.pids(n - 1):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed = time.monotonic()
        wait(lambda: "round 1: this node" in text(0))
        next_round = time.monotonic() - killed
        rcs = [p.wait(timeout=900) for p in procs[:-1]]
        total = time.monotonic() - t0
        state = json.load(open(os.path.join(out, "trainer_state.json")))
        print(f"elastic run on {n} namespace hosts (NNODES={n - 1}:{n}, DDP LoRA, tiny model): first round after "
              f"{first_round:.1f} s; host {n - 1} killed after the first checkpoint; "
              f"next round {next_round:.1f} s after the kill; finished in {total:.1f} s; survivors' exit codes "
              f"{sorted(set(rcs))}; global step {state['global_step']} of {steps}")
    finally:
        netns.kill_groups(procs, wait=False)
        hosts.close()
        print(f"logs: {tmp}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preflight", type=int, metavar="N", help="hosts for the contract + preflight hello")
    ap.add_argument("--elastic", type=int, metavar="N", help="hosts for the elastic run with one node lost")
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps of the elastic run")
    a = ap.parse_args()
    if not (a.preflight or a.elastic):
        ap.error("give --preflight N and/or --elastic N")
    why = netns.unavailable()
    if why:
        sys.exit(f"cannot make namespace hosts here: {why}")
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if a.preflight:
        preflight(a.preflight)
    if a.elastic:
        elastic(a.elastic, a.steps)
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
