"""The one place that touches DeepSpeed internals (checked against deepspeed 0.19.8).

DeepSpeed is driven through transformers' integration (``--deepspeed CONFIG.json``); this module removes a cost
that buys nothing for training, and repairs the Adam step counters of a ZeRO-3 universal checkpoint load.
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


def separate_zero3_universal_steps() -> None:
    """Give each ZeRO-3 optimizer sub group its own Adam step counter after a universal checkpoint is loaded.

    ``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`` (deepspeed 0.19.8) stores
    one and the same ``step`` tensor (read from the checkpoint's first state) in the optimizer state of every sub
    group (one per parameter group: transformers' decay and no-decay groups in full fine-tuning). torch's Adam and
    AdamW increment ``state["step"]`` in place, once per sub group per optimizer step, so with two sub groups the
    shared counter advanced twice per step and Adam's bias correction used step 4 for group 2 at the first resumed
    step (measured: the tiny model's full fine-tuning resumed at world size 1 ended 7.1e-5 away from the
    uninterrupted run, 10% of what the 2 resumed steps moved the weights; with separate counters 3e-8). A LoRA
    adapter has one non-empty group, which is why it was exact. This wraps that method so that, after it ran, each
    sub group's ``step`` is a copy of its own. Idempotent.

    Private API: ``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``,
    ``fp32_partitioned_groups_flat`` and ``optimizer.state`` (deepspeed 0.19.8). On another version the wrapper is
    still applied if the method exists, with a warning naming the version it was checked against.
    """
    import deepspeed
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    name = "load_hp_checkpoint_state_from_checkpoint_dir_stage3"
    original = getattr(Stage3, name, None)
    if original is None:
        logger.warning("deepspeed %s has no %s (checked against %s): ZeRO-3's Adam step counters after a universal "
                       "checkpoint are left as DeepSpeed loads them", deepspeed.__version__, name,
                       CHECKED_DEEPSPEED_VERSION)
        return
    if getattr(original, "sft_separate_steps", False):
        return
    if deepspeed.__version__ != CHECKED_DEEPSPEED_VERSION:
        logger.warning("deepspeed %s: separating ZeRO-3's Adam step counters after a universal checkpoint was checked "
                       "against %s only", deepspeed.__version__, CHECKED_DEEPSPEED_VERSION)

    def load(self, checkpoint_dir):
        original(self, checkpoint_dir)
        for flat in self.fp32_partitioned_groups_flat:
            state = self.optimizer.state.get(flat)
            if state is not None and torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    load.sft_separate_steps = True
    setattr(Stage3, name, load)


def convert_to_universal(input_folder: str, output_folder: str) -> None:
    """Convert one ZeRO checkpoint folder (``global_stepN``) into a universal checkpoint folder with DeepSpeed's
    converter, one worker each (no process pool). The converter is a command line (``deepspeed.checkpoint.
    ds_to_universal.main(args)``, deepspeed 0.19.8) whose arguments are given as its ``argparse`` namespace;
    ``inject_missing_state``: transformers' DeepSpeed checkpoints lack the universal-checkpoint metadata it needs.

    Raises:
        Whatever the converter raises (the caller turns it into one paragraph).
    """
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(argparse.Namespace(input_folder=input_folder, output_folder=output_folder,
                                            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                            strict=True, inject_missing_state=True))


def trainer_deepspeed_config(config: dict, training_args):
    """transformers' DeepSpeed config object for ``config`` (a dict: its ``"auto"`` values filled from
    ``training_args``: micro batch, gradient accumulation, global batch, learning rate, ...) and accelerate's
    ``DeepSpeedPlugin`` on it, as transformers 5.24's Trainer rebuilds them for hyperparameter sweeps
    (``Trainer._hp_search_setup``). ``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig`` is internal to
    transformers. Returns ``(hf_deepspeed_config, deepspeed_plugin)``; ``training_args`` is read, not written."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf_config = HfTrainerDeepSpeedConfig(config)
    hf_config.trainer_config_process(training_args)
    return hf_config, DeepSpeedPlugin(hf_ds_config=hf_config)
