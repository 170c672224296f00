"""``sft-export --for vllm`` (sft/model/vllm_adapter.py): the written expert factors, read the way vLLM reads a 3-D
expert adapter (reshape + permute, vLLM's ``LoRAModelManager._stack_moe_lora_weights``), give each expert the update
the adapter's merge writes into its weights; layouts vLLM would misread are refused in one line."""
import pytest
import torch
from safetensors.torch import load_file

from sft.app.export import export_checkpoint
from sft.cli import export_main
from sft.errors import SFTError
from sft.model.expert_lora import ExpertLoraWrapper
from sft.model.loading import apply_lora
from sft.model.spec import LoraSpec
from sft.model.vllm_adapter import DOWN, GATE_UP, vllm_delta
from sft.train.checkpoint import mark_complete
from tests.helpers.families import tiny_model


def _checkpoint(tmp_path, family, **lora):
    """A tiny base folder and a LoRA checkpoint of it (random lora_B, so that every update is non-zero)."""
    base_dir = tmp_path / "base"
    tiny_model(family, vocab_size=128).save_pretrained(base_dir)
    model = apply_lora(tiny_model(family, vocab_size=128), None, False,
                       LoraSpec(r=4, alpha=8, dropout=0.0, train_embeddings="false", **lora))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    ck = tmp_path / "checkpoint-3"
    model.save_pretrained(ck)
    mark_complete(str(ck), {})
    return model, str(ck)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # [E, out, in] experts, and gpt-oss's [E, in, out]
def test_expert_factors_read_as_vllm_reads_them_give_the_merged_update(family, tmp_path):
    model, ck = _checkpoint(tmp_path, family)
    experts = {n.replace("base_model.model.", "").replace(".base_layer", "") + "." + m.parameter_name: m
               for n, m in model.named_modules() if isinstance(m, ExpertLoraWrapper)}
    saved = load_file(f"{ck}/adapter_model.safetensors")
    base = tiny_model(family, vocab_size=128).state_dict()  # the same seed: the base the adapter was built on
    merged = model.merge_and_unload().state_dict()
    assert export_main([ck, str(tmp_path / "vllm"), "--for", "vllm"]) == 0
    out = load_file(tmp_path / "vllm" / "adapter_model.safetensors")
    assert set(out) == set(saved)  # the same tensors, expert pairs under vLLM's names
    paths = sorted({p.rpartition(".")[0] for p in experts})
    assert len(paths) == 2
    for path in paths:
        key = f"base_model.model.{path}"
        gu, dn = experts[f"{path}.{GATE_UP}"], experts[f"{path}.{DOWN}"]
        e, hidden, inter = gu.num_experts, gu.in_features, dn.in_features
        # vLLM's shapes: w13 A [r·E, hidden], B [2I, r·E]; w2 A [r·E, I], B [hidden, r·E]
        assert out[f"{key}.base_layer.lora_A.weight"].shape == (4 * e, hidden)
        assert out[f"{key}.base_layer.lora_B.weight"].shape == (2 * inter, 4 * e)
        assert out[f"{key}.lora_A.weight"].shape == (4 * e, inter)
        assert out[f"{key}.lora_B.weight"].shape == (hidden, 4 * e)
        for param in (GATE_UP, DOWN):
            want = merged[f"{path}.{param}"] - base[f"{path}.{param}"]
            if family == "gpt_oss":  # stored [E, in, out]; vLLM's update is [E, out, in]
                want = want.transpose(1, 2)
            got = vllm_delta(out, key, param, e, 8 / 4)
            assert want.abs().max() > 1e-3
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # transformers declares gate_up_proj first, so peft nested it innermost: its file already had vLLM's names
    assert all(torch.equal(out[k], saved[k]) for k in saved)


def test_layouts_vllm_would_misread_are_refused(tmp_path, capsys):
    _, ck = _checkpoint(tmp_path / "one", "qwen3_moe", target_modules=("q_proj", "down_proj"))
    with pytest.raises(SFTError, match="adapts the expert parameters down_proj; vLLM's 3-D expert LoRA needs both"):
        export_checkpoint(ck, str(tmp_path / "o1"), server="vllm")
    _, ck = _checkpoint(tmp_path / "router", "qwen3_moe", router=True)
    with pytest.raises(SFTError, match=r"mlp\.gate\.weight \(a LoRA on a 2-D parameter"):
        export_checkpoint(ck, str(tmp_path / "o2"), server="vllm")
    capsys.readouterr()
    assert export_main([ck, str(tmp_path / "o3"), "--for", "sglang"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--for sglang: not a server sft-export writes for (only vllm)" in err[0], err
    with pytest.raises(SFTError, match="with --merge the model is merged"):
        export_checkpoint(ck, str(tmp_path / "o4"), merge=True, server="vllm")
