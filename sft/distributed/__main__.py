"""The launcher's CLI (stdlib only, so ``finetune/launch.sh`` does not pay for importing torch)::

    python -m sft.distributed plan --gpus N   # validate, print the node's start line (stderr) and shell \
assignments (stdout)
    python -m sft.distributed rendezvous      # the preflight node rendezvous, from the (validated) environment
    python -m sft.distributed nodes --allocated N --source TEXT   # NNODES for a scheduler's N nodes (stdout)

Both exit 2 with ``error: ...`` on stderr when the user has something to fix (the policy of :mod:`sft.policy`).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Optional

from sft.distributed.allocator import choose_allocator
from sft.distributed.contract import choose_interface, read_contract, scheduler_nnodes, start_line
from sft.distributed.rendezvous import node_rendezvous
from sft.policy import run_cli


def _cli_plan(args) -> int:
    c = read_contract(os.environ, args.gpus)
    iface, exports = choose_interface(c, os.environ)
    allocator, preload = choose_allocator(os.environ, c.device)
    exports.update(preload)
    print(f"{start_line(c, iface)}, allocator {allocator}", file=sys.stderr, flush=True)
    # an elastic job keeps NNODES=MIN:MAX (the rendezvous step reads it again from the environment)
    values = {"NNODES": f"{c.elastic.min_nodes}:{c.nnodes}" if c.elastic else c.nnodes, "NODE_RANK": c.node_rank,
              "MASTER_ADDR": c.master_addr, "MASTER_PORT": c.master_port, "NPROC": c.nproc_per_node, "DEVICE": c.device,
              "RDZV_TIMEOUT": c.rdzv_timeout, "WORLD": c.world_size}
    e = c.elastic
    values.update({"ELASTIC": int(e is not None), "MIN_NODES": e.min_nodes if e else c.nnodes, "MAX_NODES": c.nnodes,
                   "MAX_RESTARTS": e.max_restarts if e else 0, "RDZV_ID": e.rdzv_id if e else "",
                   "RDZV_CONF": e.rdzv_conf(c.rdzv_timeout) if e else f"timeout={c.rdzv_timeout}"})
    for k, v in values.items():
        print(f"{k}={shlex.quote(str(v))}")
    for k, v in exports.items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


def _cli_rendezvous(args) -> int:
    c = read_contract(os.environ, args.gpus)
    node_rendezvous(c)
    return 0


def _cli_nodes(args) -> int:
    """NNODES for the SLURM and PBS scripts: N, or MIN:N with MIN_NODES / NNODES=MIN:MAX (an elastic job)."""
    print(scheduler_nnodes(os.environ, args.allocated, args.source))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sft.distributed",
                                     description="The launcher's environment contract and preflight rendezvous "
                                                 "(finetune/launch.sh).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn, text in (("plan", _cli_plan, "validate the environment, print the start line and shell assignments"),
                           ("rendezvous", _cli_rendezvous, "the preflight node rendezvous before torchrun")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--gpus", type=int, default=0, help="GPUs visible on this node")
        p.set_defaults(fn=fn)
    p = sub.add_parser("nodes", help="NNODES for every node of a scheduler's job: N, or MIN:N for an elastic job "
                       "(MIN_NODES=MIN or NNODES=MIN:N in the environment)")
    p.add_argument("--allocated", type=int, required=True, help="nodes the scheduler gave the job")
    p.add_argument("--source", required=True, help="where that count came from, for messages (SLURM_NNODES=3)")
    p.set_defaults(fn=_cli_nodes)
    args = parser.parse_args(argv)
    return run_cli(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
