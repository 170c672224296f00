"""Test worker run under torchrun (2 processes, gloo; tests/integration/app/test_export.py): writes an FSDP2 sharded
checkpoint as torch.distributed.checkpoint folders hold it, from a model known apart from any training run (the
reference its export is compared with; sft-train's own sharded checkpoints are exported in
tests/integration/distributed/test_fsdp.py).

``python dcp_worker.py MODEL_DIR CHECKPOINT_DIR REFERENCE_DIR``: every rank loads the tiny model, adds the same
seeded noise to every weight (so the checkpoint differs from the base), rank 0 saves that model whole to
REFERENCE_DIR (the expected result), then each layer and the root are ``fully_shard``-ed and every rank writes its own
shards with ``dcp.save({"model": state_dict})`` into ``CHECKPOINT_DIR/pytorch_model_fsdp_0`` (accelerate's layout for
FSDP2 ``SHARDED_STATE_DICT``); rank 0 adds config, tokenizer and generation config and the completion marker
(:func:`sft.train.checkpoint.mark_complete`), as a save of sft-train ends.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.fsdp import fully_shard

from sft.cli import exit_process
from sft.distributed.process_group import finish_process_group
from sft.train.checkpoint import mark_complete


def main(model_dir: str, checkpoint: str, reference: str) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    if rank == 0:
        model.save_pretrained(reference)
        tok.save_pretrained(reference)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = model.state_dict()
    assert any(type(v).__name__ == "DTensor" for v in state.values()), "fully_shard left no DTensor"
    dcp.save({"model": state}, checkpoint_id=os.path.join(checkpoint, "pytorch_model_fsdp_0"))
    dist.barrier()
    if rank == 0:
        model.config.save_pretrained(checkpoint)
        model.generation_config.save_pretrained(checkpoint)
        tok.save_pretrained(checkpoint)
        mark_complete(checkpoint, {"world_size": dist.get_world_size()})
    finish_process_group()  # a barrier, then the group destroyed, as sft-train ends
    return 0


if __name__ == "__main__":
    exit_process(main(*sys.argv[1:4]))
