"""The one place that touches DeepSpeed internals (checked against deepspeed 0.19.8).

DeepSpeed is driven through transformers' integration (``--deepspeed CONFIG.json``); this module only
removes a cost that buys nothing for training.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CHECKED_DEEPSPEED_VERSION = "0.19.8"


def skip_shm_comm_op_build() -> None:
    """Stop DeepSpeed from JIT-compiling its shared-memory all-reduce op when it starts communication.

    ``deepspeed.comm.torch.TorchBackend.__init__`` calls ``build_shm_op()``, which on a CPU machine compiles
    ``deepspeed_shm_comm_op`` with ninja (about a minute of C++ per fresh machine, minutes on a busy
    one). The op only serves ``inference_all_reduce`` (DeepSpeed-Inference tensor parallelism); ZeRO
    training uses ``torch.distributed`` collectives, so without it nothing changes for us. Returning
    ``None`` is the path DeepSpeed itself takes when the op is incompatible with the machine.

    Private API: ``deepspeed.comm.torch.build_shm_op`` (deepspeed 0.19.8). On another version the patch is
    still applied if the function exists, with a warning naming the version it was checked against.
    """
    import importlib

    import deepspeed

    # not `import deepspeed.comm.torch as m`: deepspeed.comm's attribute `torch` is the torch package itself
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")

    if not hasattr(ds_torch_comm, "build_shm_op"):
        logger.warning("deepspeed %s has no comm.torch.build_shm_op (checked against %s): its shared-memory op "
                       "may be compiled at start", deepspeed.__version__, CHECKED_DEEPSPEED_VERSION)
        return
    if deepspeed.__version__ != CHECKED_DEEPSPEED_VERSION:
        logger.warning("deepspeed %s: skipping its shm comm op build was checked against %s only",
                       deepspeed.__version__, CHECKED_DEEPSPEED_VERSION)
    ds_torch_comm.build_shm_op = lambda: None
