"""Tiny random models of today's families, built from transformers' own configs (no model hub).

:func:`tiny_config` shrinks ``transformers.AutoConfig.for_model(model_type)`` to a few thousand parameters per layer
while keeping what makes the family itself: its layer pattern (linear attention / state-space / convolution layers
beside full attention), its experts (3-D expert parameters, top-k routing, shared experts) and its vocabulary size
(``vocab_size``, the Qwen vocabulary's 151,646 by default, so that :func:`tiny_family_dir` pairs the model with
:func:`tests.helpers.assets.qwen_tokenizer_dir` for ``sft-train``).

:func:`tiny_model` builds the model in memory (fp32, seeded); :func:`tiny_family_dir` saves it with the Qwen
tokenizer into ``.cache/test-assets`` (built once, keyed on the family and the overrides).

``FAMILIES`` names the families covered: ``HYBRID`` (layers that carry a state or a window across positions),
``MOE`` (experts stored as 3-D parameters in transformers' experts layout) and ``MOE_OWN_LOOP`` (3-D experts that
transformers runs with its own ``bmm`` or loop, found beside their router).
"""
from __future__ import annotations

import hashlib
import json
import os

from tests.helpers.assets import CACHE, _atomic_build, qwen_tokenizer_dir, save_tokenizer

QWEN_VOCAB = 151646

_COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=151643, pad_token_id=None)
_LINEAR_ATTN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_num_key_heads=2, linear_num_value_heads=4)
_EXPERTS = dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8)

# model_type -> the overrides on top of _COMMON (the layer pattern written out for 4 layers where it is a list)
_SHAPES: dict[str, dict] = {
    # hybrids: Gated DeltaNet + full attention
    "qwen3_5_text": dict(_LINEAR_ATTN, num_hidden_layers=4,
                         layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(_LINEAR_ATTN, **_EXPERTS, shared_expert_intermediate_size=16, num_hidden_layers=4,
                             layer_types=["linear_attention", "linear_attention", "linear_attention",
                                          "full_attention"]),
    "qwen3_next": dict(_LINEAR_ATTN, **_EXPERTS, shared_expert_intermediate_size=16, num_hidden_layers=4,
                       layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]),
    # Kimi Delta Attention (short convolutions + gated delta rule) + MLA, MoE
    "kimi_linear": dict(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                        linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, q_lora_rank=None, kv_lora_rank=16,
                        moe_intermediate_size=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
                        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    # short causal convolutions + attention
    "lfm2": dict(num_hidden_layers=4, block_auto_adjust_ff_dim=False, conv_L_cache=3,
                 layer_types=["conv", "conv", "full_attention", "conv"]),
    # Mamba2 + attention + MLP/MoE blocks
    "nemotron_h": dict(layers_block_type=["mamba", "moe", "attention", "mlp"], num_hidden_layers=4,
                       mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1, conv_kernel=4,
                       chunk_size=8, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, num_experts_per_tok=2, n_group=1, topk_group=1,
                       use_mamba_kernels=False),
    # Mamba (1) + attention, MoE every other layer
    "jamba": dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False),
    "bamba": dict(_MAMBA2, mamba_n_heads=8, mamba_expand=2, num_hidden_layers=4,
                  attn_layer_indices=[2], use_mamba_kernels=False),
    # hybrids whose decoder layers hand their attention no position ids (the boundaries come from the decoder)
    "granitemoehybrid": dict(num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8, mamba_n_groups=1,
                             num_local_experts=0, shared_intermediate_size=64, use_mamba_kernels=False),
    "zamba": dict(num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=4, n_mamba_heads=1, attention_head_dim=16, use_mamba_kernels=False),
    # experts only (attention everywhere)
    "qwen3_moe": dict(_EXPERTS, num_hidden_layers=2),
    "gpt_oss": dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=16,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=64),
    "deepseek_v3": dict(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=16, n_group=1, topk_group=1,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, q_lora_rank=None, kv_lora_rank=16,
                        num_key_value_heads=4, head_dim=4),
    "mixtral": dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2),
    # experts as 3-D parameters that transformers runs with its own bmm / loop (no use_experts_implementation)
    "llama4_text": dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=1, intermediate_size=16,
                        intermediate_size_mlp=64, interleave_moe_layer_step=1),
    "longcat_flash": dict(num_layers=2, n_routed_experts=4, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=16,
                          ffn_hidden_size=64, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=4,
                          qk_rope_head_dim=4, v_head_dim=8, head_dim=4),
    "jetmoe": dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, kv_channels=8,
                   intermediate_size=16),
}
# multimodal checkpoints as released (a vision tower beside the language model): model_type -> its text model_type
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
               spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "kimi_linear", "lfm2", "nemotron_h", "jamba", "bamba")
HYBRID_MORE = ("granitemoehybrid", "zamba")  # hybrids beyond the list (not in HYBRID: other tests use it)
MOE = ("qwen3_moe", "qwen3_5_moe_text", "qwen3_next", "gpt_oss", "deepseek_v3", "mixtral")
MOE_OWN_LOOP = ("llama4_text", "longcat_flash", "jetmoe")  # 3-D experts beside a router, outside transformers' layout
FAMILIES = tuple(_SHAPES)


def tiny_config(model_type: str, vocab_size: int = QWEN_VOCAB, **overrides):
    """transformers' config of ``model_type`` shrunk to the tiny shape above (``overrides`` win).

    Raises KeyError for a family this module has no shape for.
    """
    from transformers import AutoConfig

    if model_type in MULTIMODAL:  # the text model's tiny shape as text_config, a one-block vision tower
        text = {**_COMMON, **_SHAPES[MULTIMODAL[model_type]], "vocab_size": vocab_size, **overrides}
        return AutoConfig.for_model(model_type, text_config=text, vision_config=dict(_VISION),
                                    tie_word_embeddings=False)
    kwargs = {**_COMMON, **_SHAPES[model_type], "vocab_size": vocab_size, **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, seed: int = 0, vocab_size: int = QWEN_VOCAB, **overrides):
    """A seeded, random, fp32 ``AutoModelForCausalLM`` of the family (eval mode off: as ``from_pretrained`` gives);
    ``AutoModelForImageTextToText`` for a :data:`MULTIMODAL` one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if model_type in MULTIMODAL else AutoModelForCausalLM
    return auto.from_config(tiny_config(model_type, vocab_size, **overrides), dtype=torch.float32)


def tiny_family_dir(model_type: str, seed: int = 0, **overrides) -> str:
    """:func:`tiny_model` saved with the Qwen tokenizer (no chat template: the ChatML fallback), built once."""
    from transformers import AutoTokenizer

    tok_dir = qwen_tokenizer_dir()
    key = hashlib.sha256(json.dumps([model_type, seed, overrides], sort_keys=True).encode()).hexdigest()[:10]

    def build(out):
        tiny_model(model_type, seed=seed, **overrides).save_pretrained(out)
        save_tokenizer(AutoTokenizer.from_pretrained(tok_dir), out)

    return _atomic_build(os.path.join(CACHE, f"tiny-{model_type}-s{seed}-{key}-{os.path.basename(tok_dir)}"), build)
