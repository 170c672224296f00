"""--bf16 auto (sft/precision.py): the choice from the CPU's flags, the flag's values on the command line and in
YAML. The bad values' messages are in tests/unit/test_bad_input.py."""
import pytest

from sft.arguments import parse_args
from sft.precision import auto_bf16, cpu_flags, parse_bf16

CPUINFO = "processor\t: 0\nmodel name\t: x\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n\nprocessor\t: 1\n"


@pytest.mark.parametrize("extra,expect", [("avx512_bf16", True), ("amx_tile amx_bf16", True), ("avx512_vnni", False)])
def test_auto_follows_the_cpu_flags(tmp_path, extra, expect):
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO.format(extra=extra))
    use, why = auto_bf16(cuda=False, cpuinfo=str(info))
    assert use is expect and ("bf16" in why)


def test_no_cpuinfo_means_fp32(tmp_path):
    assert cpu_flags(str(tmp_path / "none")) == set()
    assert auto_bf16(cuda=False, cpuinfo=str(tmp_path / "none"))[0] is False


@pytest.mark.parametrize("text,value", [("True", True), ("true", True), ("1", True), ("False", False), ("no", False),
                                        ("auto", "auto"), ("AUTO", "auto"), ("fast", "fast"), (True, True)])
def test_parse_values(text, value):
    assert parse_bf16(text) == value


def test_command_line_auto_becomes_the_machines_choice(tmp_path):
    *_, t, _ = parse_args(["--output_dir", str(tmp_path / "o"), "--bf16", "auto"])
    assert t.bf16 is auto_bf16()[0] and t.bf16_requested == "auto" and t.bf16_reason
    *_, t, _ = parse_args(["--output_dir", str(tmp_path / "o"), "--bf16"])  # bare flag: True, as transformers parses it
    assert t.bf16 is True and t.bf16_reason is None
    *_, t, _ = parse_args(["--output_dir", str(tmp_path / "o")])
    assert t.bf16 is False


def test_yaml_auto_and_boolean(tmp_path):
    (tmp_path / "a.yaml").write_text("bf16: auto\n")
    (tmp_path / "b.yaml").write_text("bf16: true\n")
    assert parse_args(["--config", str(tmp_path / "a.yaml"), "--output_dir", str(tmp_path / "o")])[2].bf16 is auto_bf16()[0]
    assert parse_args(["--config", str(tmp_path / "b.yaml"), "--output_dir", str(tmp_path / "o")])[2].bf16 is True
