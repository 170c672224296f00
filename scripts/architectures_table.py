#!/usr/bin/env python
"""Write the table of docs/architectures.md: every causal-LM family of the installed transformers, by its token mixers.

Each family (``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: what ``sft-train`` loads
with ``AutoModelForCausalLM``) is built from ``AutoConfig.for_model(model_type)`` (transformers' default config) on
the meta device (no memory, no weights; :func:`sft.model.token_mixers.meta_model`) and asked what this package's code
decides for it:

* token mixers: the layers that carry a state or window across positions (:func:`sft.model.token_mixers.mixer_kinds`),
  besides attention;
* padding-free (and ``--packing``) rows exact: :func:`sft.model.attention.use_packed_attention` switches its attention
  to the per-document implementation, and the token mixers run per document; otherwise micro batches are padded;
* sequence parallelism: refused for token mixers (:func:`sft.model.token_mixers.sequence_parallel_problem`) and
  for attention that cannot be switched;
* mixture of experts: the experts modules :func:`sft.model.experts.experts_modules` finds (3-D parameters [E, ...]
  transformers runs as experts, or beside a router of E rows), and whether ``--use_lora True``'s default targets
  (:func:`sft.model.experts.choose_targets`) adapt them; 3-D parameters that are neither experts nor convolution
  weights are named (the rule does not see them);
* Q-LoRA (``--q_lora True``): bitsandbytes' 4-bit loading stores the ``nn.Linear`` layers in NF4 (not the output
  embedding), :func:`sft.model.experts.quantize_experts` the experts modules' 3-D parameters; anything else stays in
  its dtype;
* covered by tests: the families built by ``tests/helpers/families.py`` and the tests' tiny Qwen2 / Llama / Gemma2.

Families that have a tiny shape in ``tests/helpers/families.py`` are built from it (their layer pattern), the others
from transformers' default config; those transformers cannot build on the meta device are listed by the error.

Usage, from the repository root (it reads tests/helpers/families.py):
    python -m scripts.architectures_table [--check]   (--check: exit 1 when docs/architectures.md is not current)
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "architectures.md")
BEGIN = "<!-- table: written by scripts/architectures_table.py, do not edit by hand -->"
END = "<!-- end of table -->"
TESTED_ELSEWHERE = ("qwen2", "llama", "gemma2")  # tests/helpers/assets.py and the attention tests


def tested_families() -> set[str]:
    from tests.helpers.families import FAMILIES, MULTIMODAL

    return set(FAMILIES) | set(MULTIMODAL) | set(TESTED_ELSEWHERE)


def family_config(model_type: str):
    """The config the table builds: the tests' tiny shape where ``tests/helpers/families.py`` has one (it keeps the
    family's layer pattern: LFM2's default config, for one, has attention in every layer), else transformers'
    default (``AutoConfig.for_model``)."""
    from transformers import AutoConfig

    from tests.helpers.families import FAMILIES, MULTIMODAL, tiny_config

    if model_type in FAMILIES or model_type in MULTIMODAL:
        return tiny_config(model_type, vocab_size=128)
    return AutoConfig.for_model(model_type)


def family_row(model_type: str) -> dict:
    """One family's decisions: ``{"kinds": [...], "packed": bool, "mask": bool, **moe_facts(model)}`` (``mask``: the
    model class takes transformers' attention backends, so ``--packing`` gets the block-diagonal mask from the
    position ids). Raises what transformers raises when the config cannot be built."""
    from sft.model.attention import use_packed_attention
    from sft.model.token_mixers import meta_model, mixer_kinds

    model = meta_model(family_config(model_type))
    mask = bool(getattr(model, "_supports_sdpa", False) or getattr(model, "_supports_attention_backend", False))
    return {"kinds": mixer_kinds(model), "packed": use_packed_attention(model), "mask": mask, **moe_facts(model)}


def moe_facts(model) -> dict:
    """What the expert rule finds in ``model`` (built on the meta device): ``experts`` (the experts' 3-D parameter
    names), ``num_experts`` (E, from the experts modules), ``lora_experts`` (the default LoRA targets include them),
    ``linears`` (``nn.Linear`` layers other than the output embedding: bitsandbytes' 4-bit loading stores them NF4)
    and ``other_3d`` (3-D parameters that are neither experts nor convolution weights: left in their dtype, not
    adapted by the expert rule)."""
    import torch

    from sft.model.experts import choose_targets, expert_parameter_names, experts_modules, lora_candidates, num_experts

    experts, num, seen = [], set(), set()
    for _, m, _ in experts_modules(model):
        num.add(num_experts(m))
        experts += [n for n in expert_parameter_names(m) if n not in experts]
        seen.update(id(p) for p in m.parameters(recurse=False))
    convs = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    other = sorted({".".join(n.split(".")[-2:]) for mn, m in model.named_modules() if not isinstance(m, convs)
                    for n, p in m.named_parameters(prefix=mn, recurse=False) if p.ndim == 3 and id(p) not in seen})
    candidates = lora_candidates(model, lambda m: isinstance(m, torch.nn.Linear))
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {"experts": experts, "num_experts": sorted(num),
            "lora_experts": any(t.kind == "experts" for t in choose_targets(candidates, None, router=False)),
            "linears": any(isinstance(m, torch.nn.Linear) and m is not out_emb for m in model.modules()),
            "other_3d": other}


def _moe_cells(row: dict) -> tuple[str, str]:
    """The MoE and Q-LoRA cells of :func:`family_row`'s facts."""
    other = ", ".join(f"`{n}`" for n in row["other_3d"])
    if row["experts"]:
        names = ", ".join(f"`{n}`" for n in row["experts"])
        e = "/".join(str(n) for n in row["num_experts"])
        moe = f"yes: E={e}, {names}; LoRA " + ("adapts them by default" if row["lora_experts"] else "not by default")
    else:
        moe = "no 3-D experts"
    if other:
        moe += f"; 3-D {other} not taken for experts"
    stored = [s for s, ok in (("experts", row["experts"]), ("linears", row["linears"])) if ok]
    qlora = (" + ".join(stored) + " NF4") if stored else "nothing 4-bit"
    if other:
        qlora += f"; {other} stay in their dtype"
    return moe, qlora


def _cells(row: dict) -> tuple[str, ...]:
    return _mixer_cells(row) + _moe_cells(row)


def _mixer_cells(row: dict) -> tuple[str, str, str, str]:
    kinds = row["kinds"]
    mixers = ", ".join(f"`{k}`" for k in kinds) if kinds else "none found"
    if not row["packed"]:
        packing = ("`--packing`: block-diagonal mask" + (", mixers per document" if kinds else "") if row["mask"]
                   else "`--packing`: not checked (no attention backend of transformers: rows may leak)")
        cell = f"padding-free: padded; {packing}"
        return mixers, cell, cell, "refused"
    cpu = "exact: attention per document" + (", mixers per document" if kinds else "")
    cuda = "exact: one varlen attention call per layer" + (", mixers per document (not run on a GPU)" if kinds else "")
    sp = "refused (state not passed between ranks)" if kinds else "yes"
    return mixers, cpu, cuda, sp


def render() -> str:
    """The table and the families that did not build, as markdown (the text between the page's markers)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    tested = tested_families()
    lines = ["| family (`model_type`) | tested | layers carrying a state (found) | padding-free / packed, CPU | "
             "padding-free / packed, CUDA | sequence parallelism | MoE (3-D experts) | Q-LoRA (`--q_lora`) |",
             "|---|---|---|---|---|---|---|---|"]
    failed = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = family_row(model_type)
        except Exception as e:  # noqa: BLE001 - reported in the page, by the error's type
            failed.append(f"`{model_type}` ({type(e).__name__})")
            continue
        cells = _cells(row)
        lines.append(f"| `{model_type}` | {'yes' if model_type in tested else ''} | " + " | ".join(cells) + " |")
    built = len(lines) - 2
    head = (f"transformers {transformers.__version__}: {built + len(failed)} causal-LM families, {built} built on the "
            f"meta device, {len(failed)} not.")
    tail = f"Not built from their default config: {', '.join(failed)}." if failed else ""
    return "\n".join([head, "", *lines, "", tail]).rstrip() + "\n"


def page_with(table: str, page: str) -> str:
    """``page`` with the text between :data:`BEGIN` and :data:`END` replaced by ``table``. Raises ValueError when the
    page lacks the markers."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing")
    before, rest = page.split(BEGIN, 1)
    return before + BEGIN + "\n" + table + END + rest.split(END, 1)[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/architectures.md is not current")
    args = p.parse_args(argv)
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    new = page_with(render(), page)
    if args.check:
        if new != page:
            print(f"{PAGE} is not current: run python -m scripts.architectures_table", file=sys.stderr)
            return 1
        return 0
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
