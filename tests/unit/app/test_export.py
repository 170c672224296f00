"""sft-export's rules that need no model (sft/app/export.py): which kind of checkpoint a folder holds, where its
torch.distributed.checkpoint shards are, and the refusals before anything loads. The exports themselves are in
tests/integration/app/test_export.py."""
import os

import pytest

from sft.app.export import check_checkpoint, checkpoint_kind, dcp_folder, export_checkpoint
from sft.errors import SFTError
from sft.train.checkpoint import mark_complete


def _folder(root, *files):
    for rel in files:
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
    return str(root)


@pytest.mark.parametrize("files,kind", [
    (["adapter_config.json", "adapter_model.safetensors", "latest",
      "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"], "lora"),  # a LoRA run under ZeRO: the adapter
    (["model.safetensors", "latest", "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
      "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"], "zero"),  # ZeRO-3's gathered copy: the shards win
    (["config.json", "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp"], "dcp"),
    (["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"], "full"),
    (["config.json", "model.safetensors", "pytorch_model_fsdp.bin", "optimizer.bin"], "full"),  # FSDP2, full state
], ids=["lora", "zero", "dcp", "sharded-full", "fsdp2-full"])
def test_checkpoint_kind(tmp_path, files, kind):
    assert checkpoint_kind(_folder(tmp_path, *files)) == kind


def test_dcp_folder_is_the_models_not_the_optimizers(tmp_path):
    root = _folder(tmp_path, "optimizer_0/.metadata", "pytorch_model_fsdp_0/.metadata")
    assert dcp_folder(root) == os.path.join(root, "pytorch_model_fsdp_0")
    assert dcp_folder(_folder(tmp_path / "own", ".metadata", "__0_0.distcp")) == str(tmp_path / "own")
    assert dcp_folder(_folder(tmp_path / "none", "optimizer_0/.metadata")) is None


def test_unknown_layout_and_missing_or_output_folders_refused(tmp_path):
    with pytest.raises(SFTError, match="holds no weights sft can export"):
        checkpoint_kind(_folder(tmp_path / "empty", "config.json"))
    with pytest.raises(SFTError, match="a LoRA adapter in FSDP2 shards .* is not exported by sft-export yet"):
        checkpoint_kind(_folder(tmp_path / "lora-shards", "adapter_config.json", "config.json",
                                "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp"))
    with pytest.raises(SFTError, match="no such folder"):
        check_checkpoint(str(tmp_path / "missing"))
    out = tmp_path / "run"
    done = _folder(out / "checkpoint-2", "model.safetensors")
    mark_complete(done, {})
    _folder(out / "checkpoint-4", "model.safetensors")  # killed before its marker
    with pytest.raises(SFTError, match=f"not a checkpoint; give one of them \\(e.g. its newest complete one, {done}"):
        check_checkpoint(str(out))
    with pytest.raises(SFTError, match="no completion marker"):
        check_checkpoint(str(out / "checkpoint-4"))
    check_checkpoint(done)


def test_flags_that_do_not_fit_the_checkpoint_refused_before_loading(tmp_path):
    full = _folder(tmp_path / "full", "config.json", "model.safetensors")
    mark_complete(full, {})
    lora = _folder(tmp_path / "lora", "adapter_config.json", "adapter_model.safetensors")
    mark_complete(lora, {})
    with pytest.raises(SFTError, match="holds a full model, not a LoRA adapter"):
        export_checkpoint(full, str(tmp_path / "o"), merge=True)
    with pytest.raises(SFTError, match="--base: names the model a LoRA adapter is merged into; add --merge"):
        export_checkpoint(lora, str(tmp_path / "o"), base=str(tmp_path))
    with pytest.raises(SFTError, match="--dtype int8"):
        export_checkpoint(full, str(tmp_path / "o"), dtype="int8")
    with pytest.raises(SFTError, match="--max_shard_size 5 GB: give a size such as 5GB"):
        export_checkpoint(full, str(tmp_path / "o"), max_shard_size="5 GB")
    with pytest.raises(SFTError, match="is, holds or lies inside the checkpoint folder"):
        export_checkpoint(full, os.path.join(full, "exported"))
    assert not (tmp_path / "o").exists()
