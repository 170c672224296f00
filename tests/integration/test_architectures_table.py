"""docs/architectures.md's table is the output of scripts/architectures_table.py (every causal-LM family of the
installed transformers built on the meta device: ~15 s of CPU, hence this tier)."""
import pytest

from scripts import architectures_table as table


def test_committed_page_is_the_scripts_output():
    with open(table.PAGE, encoding="utf-8") as f:
        page = f.read()
    assert table.page_with(table.render(), page) == page, "run python -m scripts.architectures_table"


def test_rows_follow_the_code():
    """A hybrid's row names its mixer and refuses sequence parallelism; an attention-only family is exact and
    takes it; a family with a sliding window is padded padding-free; a MoE's 3-D experts are found, adapted by
    default and stored 4-bit under Q-LoRA, a convolution's 3-D weight is not taken for experts."""
    qwen = table._cells(table.family_row("qwen3_5_text"))
    assert qwen[0] == "`Qwen3_5GatedDeltaNet`" and "mixers per document" in qwen[1] and qwen[3].startswith("refused")
    assert table._cells(table.family_row("llama")) == (
        "none found", "exact: attention per document", "exact: one varlen attention call per layer", "yes",
        "no 3-D experts", "linears NF4")
    moe = table._cells(table.family_row("qwen3_moe"))
    assert moe[4] == "yes: E=8, `gate_up_proj`, `down_proj`; LoRA adapts them by default" \
        and moe[5] == "experts + linears NF4"
    assert qwen[4:] == ("no 3-D experts", "linears NF4")  # its depthwise Conv1d weight is 3-D, not experts
    assert table._cells(table.family_row("gemma2"))[1].startswith("padding-free: padded")
    with pytest.raises(ValueError, match="markers"):
        table.page_with("x", "no markers here")
