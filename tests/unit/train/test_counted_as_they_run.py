"""Mixture-of-experts and hybrid models counted as they run (issue 52 item 7, issue 51 item 5): FLOPs per token with
routed experts at top_k / E, routers and the state-carrying mixers by their own formulas (sft.train.counting), and the
memory plan's parameters line and Mamba2 chunk buffers (sft.train.memory_plan). Tiny random models of
tests/helpers/families.py, vocabulary 128, built in-process.

Attention's length term: full attention's score and value products are not counted (model FLOPs as PaLM's, module
docstring of sft.train.counting), so "6 x active parameters" is compared with the count of weights alone; the mixers
of the hybrids are counted apart, per token (linear in the length)."""
import pytest
import torch

from sft.train.counting import GDN_CHUNK, census, model_flops_per_token
from sft.train.memory_plan import GIB, plan
from sft.train.metrics import linear_weight_counts
from tests.helpers.families import tiny_model

TOP_K = ("num_experts_per_tok", "num_experts_per_token")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _config_value(config, names):
    return next(getattr(config, n) for n in names if isinstance(getattr(config, n, None), int))


def active_parameters(model) -> float:
    """Parameters a token runs through, by names and the config (independently of sft.train.counting): every
    parameter less the input embedding (a lookup), the routed experts' (``.experts.``, leading dim E) at top_k / E."""
    k, e = _config_value(model.config, TOP_K), _config_value(model.config, EXPERTS)
    embedding = model.get_input_embeddings().weight
    total = 0.0
    for name, p in model.named_parameters():
        if p is embedding:
            continue
        routed = ".experts." in name and p.dim() >= 2 and p.shape[0] == e
        total += p.numel() * (k / e if routed else 1)
    return total


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"])
def test_full_fine_tuning_flops_are_six_times_the_active_parameters(family):
    model = tiny_model(family, vocab_size=128)
    k, e = _config_value(model.config, TOP_K), _config_value(model.config, EXPERTS)
    c = census(model)
    assert {(ee, kk) for _, ee, kk in c.experts} == {(e, k)} and c.experts
    assert c.total == sum(p.numel() for p in model.parameters())  # each parameter once
    flops, six = model_flops_per_token(model), 6 * active_parameters(model)
    assert abs(flops / six - 1) < 0.05, (flops, six)
    routed = c.weights[("experts", True)] + c.weights.get(("router", True), 0)
    assert routed > 0 and 6 * sum(linear_weight_counts(model)) == flops - 6 * routed  # the count before: nn.Linear
    # frozen experts (a LoRA base): their weights lose the weight gradient's 2 FLOPs, at top_k / E of their size
    expert_weights = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3)
    for n, p in model.named_parameters():
        p.requires_grad_(".experts." not in n)
    assert flops - model_flops_per_token(model) == 2 * expert_weights * k // e


def _mixer_formula(family, c) -> tuple[str, int, int]:
    """(kind, number of such layers, forward FLOPs per token of one) from the config, by the formulas of
    sft.train.counting's docstring."""
    if family in ("qwen3_5_text", "kimi_linear"):
        h = getattr(c, "linear_num_value_heads", None) or c.linear_num_heads
        dk = getattr(c, "linear_key_head_dim", None) or c.linear_head_dim
        dv = getattr(c, "linear_value_head_dim", None) or c.linear_head_dim
        return ("gated_delta_rule", c.layer_types.count("linear_attention"),
                int(h * (GDN_CHUNK * (6 * dk + 4 * dv) + GDN_CHUNK ** 2 / 3 + 6 * dk * dv)))
    if family == "nemotron_h":
        h, p, n, q = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.chunk_size
        mamba = c.layer_types.count("linear_attention")  # transformers 5.24 names Nemotron-H's Mamba2 layers so
        return "mamba2_ssd", mamba, h * (2 * q * (n + p) + 4 * n * p)
    if family == "bamba":
        h, p, n, q = c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state, c.mamba_chunk_size
        return ("mamba2_ssd", c.num_hidden_layers - len(c.attn_layer_indices), h * (2 * q * (n + p) + 4 * n * p))
    if family == "jamba":
        return "mamba", c.num_hidden_layers - c.num_hidden_layers // c.attn_layer_period, \
            9 * c.mamba_expand * c.hidden_size * c.mamba_d_state
    return None, 0, 0  # lfm2: short convolutions only, which are weights


@pytest.mark.parametrize("family", ["qwen3_5_text", "kimi_linear", "nemotron_h", "bamba", "jamba", "lfm2"])
def test_hybrid_mixers_are_counted_by_their_own_formula_and_convolutions_are_no_experts(family):
    model = tiny_model(family, vocab_size=128)
    kind, layers, per_layer = _mixer_formula(family, model.config)
    c = census(model)
    assert [m[1] for m in c.mixers] == [kind] * layers
    assert c.mixer_flops == layers * per_layer
    convs = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Conv1d))
    assert convs > 0 and c.weight_count() == sum(linear_weight_counts(model)) + convs + sum(
        n for (kind_, _), n in c.weights.items() if kind_ in ("experts", "router")) - sum(
        m.in_features * m.out_features for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".experts." in name)
    if family in ("qwen3_5_text", "lfm2", "bamba"):  # depthwise Conv1d weights [C, 1, K] are 3-D: still no experts
        assert c.experts == [] and c.expert_total == 0
    assert model_flops_per_token(model) == 6 * c.weight_count() + 3 * c.mixer_flops


def test_expert_lora_is_counted_at_top_k_over_e():
    """peft's ParamWrapper adapters (r x E wide) count at top_k / E, like the experts they adapt."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model("qwen3_moe", vocab_size=128).to(torch.bfloat16)
    bf16 = census(base)
    r, e, k, layers = 4, 8, 2, base.config.num_hidden_layers
    lora = get_peft_model(base, LoraConfig(r=r, lora_dropout=0.0, target_modules=["q_proj"],
                                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    c = census(lora)
    per_expert = r * ((32 + 32) + (16 + 32))  # gate_up_proj [E, 32, 32] and down_proj [E, 32, 16]: r (in + out)
    assert c.weights[("experts", True)] == layers * e * per_expert * k / e
    assert c.weights[("dense", True)] == layers * r * (32 + 32)  # q_proj
    assert c.expert_total == bf16.expert_total and c.weight_count(False) == bf16.weight_count()


def test_nf4_experts_are_counted_as_the_matrices_they_stand_for_and_named_in_the_plan():
    """4-bit experts (bitsandbytes' replace_parameter_4bit) count as the matrices they stand for, stored in <= 0.3x
    the bf16 bytes; the memory plan's line names total, expert and active parameters and the experts' storage."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    bf16 = census(tiny_model("qwen3_moe", vocab_size=128).to(torch.bfloat16))
    quantized = tiny_model("qwen3_moe", vocab_size=128).to(torch.bfloat16)
    for m in quantized.modules():
        if type(m).__name__.endswith("Experts"):
            for name in ("gate_up_proj", "down_proj"):
                replace_parameter_4bit(m, name, quant_type="nf4")
    q = census(quantized)
    assert (q.total, q.expert_total, q.active, q.expert_dtypes) == (bf16.total, bf16.expert_total, bf16.active,
                                                                     {"nf4"})
    assert q.expert_bytes <= 0.3 * bf16.expert_bytes
    line = plan(quantized, tokens=64, checkpointing=False, optim="sgd", held_available=(0, GIB, "test")).line()
    assert line.endswith(f"; parameters {q.total} ({q.expert_total} in routed experts, {q.expert_bytes / GIB:.2f} "
                         f"GiB in nf4; {q.active} active per token)")


def test_mamba2_chunk_buffers_grow_with_the_square_of_the_chunks():
    """The plan adds Mamba2's PyTorch chunk buffers (heads x (chunks + 1)^2 fp32, SSD_CHUNK_TENSORS of them): at 8x
    the tokens the activations grow by more than 8x; a model without Mamba2 layers stays linear."""
    from sft.train.activations import SSD_CHUNK_TENSORS

    model = tiny_model("nemotron_h", vocab_size=128)
    kw = dict(checkpointing=False, optim="sgd", measured=(1000.0, 250.0), held_available=(0, GIB, "test"))
    small, big = plan(model, tokens=1024, **kw), plan(model, tokens=8192, **kw)
    heads, chunk = model.config.mamba_num_heads, model.config.chunk_size
    assert small.activations - small.per_token * 1024 == SSD_CHUNK_TENSORS * heads * (1024 // chunk + 1) ** 2 * 4
    assert big.activations > 8 * small.activations
    dense = tiny_model("qwen3_moe", vocab_size=128)
    assert plan(dense, tokens=8192, **kw).activations == 8 * plan(dense, tokens=1024, **kw).activations


def test_checkpointed_layers_fall_once_a_layer_block_is_mmapped():
    """With checkpointing on CPU, once one layer's hidden-sized block (tokens x hidden x bytes) reaches glibc's 32 MiB
    mmap threshold the plan holds every layer's input plus CHECKPOINTED_LAYERS_MMAPPED layers, not the heap-slack
    count measured at 2k-8k tokens; on CUDA, and below the threshold, the measured count stays."""
    from sft.train.activations import CHECKPOINTED_LAYERS, CHECKPOINTED_LAYERS_MMAPPED, MMAP_THRESHOLD_MAX

    model = tiny_model("qwen3_moe", vocab_size=128)
    h, layers, layer = model.config.hidden_size, model.config.num_hidden_layers, 5000.0
    long = MMAP_THRESHOLD_MAX // (h * 4)  # fp32: the first token count whose block is mmapped
    # a probe total well above the checkpointed count, so that checkpointing pays (the plan takes the smaller)
    kw = dict(checkpointing=True, optim="sgd", measured=(100 * layer, layer), held_available=(0, GIB, "test"))
    inputs = layers * 4 * h
    assert plan(model, tokens=long - 1, **kw).per_token == int(inputs + CHECKPOINTED_LAYERS[4] * layer)
    mmapped = plan(model, tokens=long, **kw)
    assert mmapped.per_token == int(inputs + CHECKPOINTED_LAYERS_MMAPPED * layer)
    # the LM head's peak and the recomputed layers' do not overlap: the head counts only above the latter
    assert mmapped.head == max(0, mmapped.head_for(long) - int(CHECKPOINTED_LAYERS_MMAPPED * layer * long))
    cuda = plan(model, tokens=long, device=torch.device("cuda"), **kw)
    assert cuda.per_token == int(inputs + CHECKPOINTED_LAYERS[4] * layer)
