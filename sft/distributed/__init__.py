"""Multi-node and multi-process runs, one module per job.

* :mod:`sft.distributed.contract` -- the launcher's environment contract (``NNODES``, ``NODE_RANK``,
  ``MASTER_ADDR``, ...) and the network interface choice. Standard library only: the shell launcher
  evaluates it without importing torch.
* :mod:`sft.distributed.rendezvous` -- the preflight node rendezvous before torchrun (standard library only).
* :mod:`sft.distributed.process_group` -- the one owner of the runtime inside the training processes:
  CPU/gloo choice, the process group with ``--ddp_timeout``, DeepSpeed's communication start.
* :mod:`sft.distributed.collectives` -- every collective the other folders run (barrier, gather, broadcast, any /
  all ranks), each a no-op for one process or without a process group.
* :mod:`sft.distributed.fingerprints` -- every rank compares its inputs (data, model config, tokenizer).
* :mod:`sft.distributed.failures` -- a lost peer or a timed-out collective explained by node rank and host.
* ``python -m sft.distributed plan|rendezvous`` -- the launcher's CLI (:mod:`sft.distributed.__main__`).

This package's ``__init__`` imports nothing, so ``import sft.distributed.contract`` stays torch-free.
"""
