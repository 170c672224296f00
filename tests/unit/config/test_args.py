"""Command line: Qwen flag names, YAML defaults, every problem reported at once."""
import pytest

from sft.app.validation import validate
from sft.config.arguments import parse_args
from sft.errors import ConfigError


def test_qwen_flags_and_removed_hf_flags_map(tiny_model_dir, toy_data, tmp_path):
    m, d, t, l = parse_args([
        "--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir", str(tmp_path / "o"),
        "--use_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1",
        "--lora_target_modules", "q_proj", "v_proj", "--lora_bias", "none", "--lazy_preprocess", "True",
        "--model_max_length", "512", "--evaluation_strategy", "no", "--warmup_ratio", "0.01",
        "--group_by_length", "True", "--report_to", "none"])
    validate(m, d, t, l)
    assert t.use_lora and l.lora_r == 8 and l.lora_target_modules == ["q_proj", "v_proj"] and d.lazy_preprocess
    assert t.eval_strategy == "no" and t.warmup_steps == 0.01 and t.train_sampling_strategy == "group_by_length"
    assert t.use_cpu  # no CUDA here: train on CPU explicitly


def test_yaml_defaults_and_command_line_wins(tiny_model_dir, toy_data, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndata_path: {toy_data}\nlora_r: 4\nlearning_rate: 0.5\n"
                   f"use_lora: true\noutput_dir: {tmp_path / 'o'}\n")
    m, d, t, l = parse_args(["--config", str(cfg), "--lora_r", "16"])
    assert l.lora_r == 16 and t.learning_rate == 0.5 and m.model_name_or_path == tiny_model_dir and t.use_lora


def test_yaml_synonyms_of_the_sequence_parallel_size(tmp_path):
    cfg = tmp_path / "c.yaml"
    for key in ("sp_size", "sequence_parallel_degree", "context_parallel_size"):
        cfg.write_text(f"{key}: 4\n")
        assert parse_args(["--config", str(cfg)])[2].sequence_parallel_size == 4
    cfg.write_text("sp_size: 4\nsequence_parallel_size: 2\n")
    with pytest.raises(ConfigError, match="both 'sp_size' and 'sequence_parallel_size' are given"):
        parse_args(["--config", str(cfg)])


@pytest.mark.parametrize("text,fragment", [
    ("lora_alhpa: 4\n", "unknown key 'lora_alhpa' (did you mean 'lora_alpha'?)"),
    ("lora_r: [1\n", "not valid YAML"),
    ("- a\n- b\n", "must be a mapping"),
])
def test_bad_yaml(tmp_path, text, fragment):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(cfg)])
    assert fragment in str(e.value) and str(cfg) in str(e.value)


def test_every_problem_at_once(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    m, d, t, l = parse_args(["--data_path", str(tmp_path), "--output_dir", str(f), "--fp16", "True",
                             "--lora_r", "0", "--lora_dropout", "1.5", "--model_max_length", "2",
                             "--deepspeed", "ds.json", "--q_lora", "True", "--chat_template_kwargs", "[1]"])
    with pytest.raises(ConfigError) as e:
        validate(m, d, t, l)
    msg = str(e.value)
    for frag in ["--model_name_or_path is required", f"--data_path {tmp_path}: is a directory",
                 "--fp16 True: fp16 training needs a CUDA GPU", "--lora_r 0", "--lora_dropout 1.5",
                 "--model_max_length 2", f"--output_dir {f}: is a file", "--deepspeed ds.json: no such file",
                 "--q_lora True: Q-LoRA trains a LoRA adapter",
                 "--chat_template_kwargs [1]: a JSON object is needed"]:
        assert frag in msg, frag
    assert "10 problems" in msg


def test_model_folder_without_config(tmp_path, toy_data):
    m, d, t, l = parse_args(["--model_name_or_path", str(tmp_path), "--data_path", toy_data,
                             "--output_dir", str(tmp_path / "o")])
    with pytest.raises(ConfigError, match="no config.json"):
        validate(m, d, t, l)


@pytest.mark.parametrize("tty, flag, expected", [(False, [], True), (True, [], False),
                                                 (False, ["--disable_tqdm", "False"], False),
                                                 (True, ["--disable_tqdm", "True"], True)])
def test_progress_bar_off_when_stderr_is_no_terminal(tiny_model_dir, toy_data, tmp_path, monkeypatch, tty, flag,
                                                     expected):
    # a job log (stderr a file) gets no tqdm bar spliced into its lines; a flag given wins either way
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
    _, _, t, _ = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data,
                             "--output_dir", str(tmp_path / "o"), *flag])
    assert t.disable_tqdm is expected
