"""--bf16 auto (sft/config/precision.py): the choice from the CPU's flags, the flag's values on the command line and in
YAML. The bad values' messages are in tests/integration/app/test_bad_input_corpus.py."""
import pytest

from sft.config import precision
from sft.config.arguments import parse_args
from sft.config.precision import auto_bf16, cpu_flags, parse_bf16

CPUINFO = "processor\t: 0\nmodel name\t: x\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n\nprocessor\t: 1\n"


@pytest.mark.parametrize("extra,expect", [("avx512_bf16", True), ("amx_tile amx_bf16", True), ("avx512_vnni", False)])
def test_auto_follows_the_cpu_flags(tmp_path, monkeypatch, extra, expect):
    monkeypatch.setattr(precision, "matmul_probe", lambda: (200e9, 430e9))  # fp32, bf16 FLOP/s
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO.format(extra=extra))
    use, why = auto_bf16(cuda=False, cpuinfo=str(info))
    assert use is expect and ("bf16" in why)


def test_flag_without_fast_bf16_means_fp32(tmp_path, monkeypatch):
    """A machine with the flag whose bf16 matmul is emulated (seen: 1 GFLOP/s against 159 in fp32)."""
    monkeypatch.setattr(precision, "matmul_probe", lambda: (159e9, 1e9))
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO.format(extra="avx512_bf16"))
    use, why = auto_bf16(cuda=False, cpuinfo=str(info))
    assert use is False and "slower than fp32" in why and "bf16 1, fp32 159 GFLOP/s" in why


def test_probe_measures_both_dtypes_and_leaves_the_global_rng_alone():
    import torch

    state = torch.get_rng_state()
    fp32, bf16 = precision.matmul_probe(n=64, repeats=2)
    assert 0 < fp32 < float("inf") and 0 < bf16 < float("inf")
    assert torch.equal(state, torch.get_rng_state())  # LoRA init and dropout draw from it after the probe


def test_ranks_agree_through_the_process_group(tmp_path):
    import torch.distributed as dist

    assert precision.agree_across_ranks(True) is True  # no process group: this process's choice
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert precision.agree_across_ranks(True) is True and precision.agree_across_ranks(False) is False
    finally:
        dist.destroy_process_group()


def test_no_cpuinfo_means_fp32(tmp_path):
    assert cpu_flags(str(tmp_path / "none")) == set()
    assert auto_bf16(cuda=False, cpuinfo=str(tmp_path / "none"))[0] is False


@pytest.mark.parametrize("text,value", [("True", True), ("true", True), ("1", True), ("False", False), ("no", False),
                                        ("auto", "auto"), ("AUTO", "auto"), ("fast", "fast"), (True, True)])
def test_parse_values(text, value):
    assert parse_bf16(text) == value


def test_command_line_auto_becomes_the_machines_choice(tmp_path):
    *_, t, _ = parse_args(["--output_dir", str(tmp_path / "o"), "--bf16", "auto"])
    assert t.bf16 is auto_bf16()[0] and t.parsed.bf16 == "auto" and t.parsed.bf16_reason
    *_, t, _ = parse_args(["--output_dir", str(tmp_path / "o"), "--bf16"])  # bare flag: True, as transformers parses it
    assert t.bf16 is True and t.parsed.bf16_reason is None
    *_, t, _ = parse_args(["--output_dir", str(tmp_path / "o")])
    assert t.bf16 is False


def test_yaml_auto_and_boolean(tmp_path):
    (tmp_path / "a.yaml").write_text("bf16: auto\n")
    (tmp_path / "b.yaml").write_text("bf16: true\n")
    assert parse_args(["--config", str(tmp_path / "a.yaml"), "--output_dir", str(tmp_path / "o")])[2].bf16 is \
        auto_bf16()[0]
    assert parse_args(["--config", str(tmp_path / "b.yaml"), "--output_dir", str(tmp_path / "o")])[2].bf16 is True
