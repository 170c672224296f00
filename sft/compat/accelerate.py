"""The one place that touches accelerate internals for FSDP2 (checked against accelerate 1.15.0).

FSDP2 is driven through transformers' integration (``--fsdp --fsdp_config CONFIG.json``): the Trainer builds
accelerate's ``FullyShardedDataParallelPlugin`` and accelerate wraps the model with
``torch.distributed.fsdp.fully_shard``. On CPU, accelerate 1.15 drops the plugin: ``AcceleratorState.__init__``
sets ``DistributedType.FSDP`` only in its branch for GPU-family process groups (MULTI_GPU, MULTI_NPU,
MULTI_XPU, ...), never for MULTI_CPU, so the Trainer would silently train with DDP. torch 2.13's
``fully_shard`` itself runs on CPU with gloo (all-gather and reduce-scatter of DTensor shards), so this
module puts the plugin back where accelerate 1.15 would have put it on GPUs.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CHECKED_ACCELERATE_VERSION = "1.15.0"


def enable_fsdp_on_cpu(accelerator, plugin_args: dict) -> bool:
    """Turn FSDP2 on for an ``accelerate.Accelerator`` of a CPU process group that dropped its FSDP plugin.

    Sets what ``AcceleratorState.__init__`` (accelerate 1.15.0) sets for GPU-family process groups:
    ``state.distributed_type = DistributedType.FSDP``, ``state.fsdp_plugin`` (built from ``plugin_args``, the
    Trainer's ``args.fsdp_plugin_args``), and ``PartialState._shared_state["distributed_type"]`` (every later
    ``AcceleratorState()`` re-reads the distributed type from there; without it the state falls back to
    MULTI_CPU at the first training step and the final save gathers on rank 0 only, which hangs).
    Returns True when it changed the state, False when there was nothing to do (GPU runs, one process,
    accelerate already using FSDP).

    Private API: ``AcceleratorState`` / ``PartialState._shared_state`` (accelerate 1.15.0). On another
    version it is still applied, with a warning naming the version it was checked against.
    """
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU or getattr(state, "fsdp_plugin", None) is not None:
        return False
    if accelerate.__version__ != CHECKED_ACCELERATE_VERSION:
        logger.warning("accelerate %s: FSDP2 on CPU was checked against accelerate %s only",
                       accelerate.__version__, CHECKED_ACCELERATE_VERSION)
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def fsdp_sharded_state(accelerator, model, optimizer) -> tuple[dict, dict]:
    """This rank's shards of an FSDP2 model (LoRA: the adapter only) and optimizer, as accelerate's
    ``save_fsdp_model(adapter_only=True)`` and ``save_fsdp_optimizer`` would write them under ``SHARDED_STATE_DICT``:
    ``(model state dict, optimizer state dict)`` of ``DTensor``\\ s (no gather). Private API: accelerate 1.15.0's
    ``_prepare_sd_options`` and ``_get_model_state_dict``."""
    from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = _prepare_sd_options(accelerator.state.fsdp_plugin)
    return (_get_model_state_dict(model, adapter_only=True, sd_options=options),
            get_optimizer_state_dict(model, optimizer, options=options))


def fsdp_shard_folders() -> tuple[str, str]:
    """The folders of a checkpoint that hold the model's and the optimizer's shards under ``SHARDED_STATE_DICT``
    (accelerate 1.15.0: ``{FSDP_MODEL_NAME}_0`` and ``{OPTIMIZER_NAME}_0``, keyed ``"model"`` and ``"optimizer"``)."""
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

    return f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0"
