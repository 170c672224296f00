"""``--expert_parallel_size N``'s refusals (sft/app/expert_parallel.py; the launcher's check, sft/app/check.py
``launch_shape``, for the world sizes): one line each, naming the flag, the value and the fix; the experts counted
from the model's config (its module tree on the meta device)."""
import os
import re

import pytest

from sft.app.check import launch_shape
from sft.app.expert_parallel import expert_parallel_problems
from sft.config.arguments import parse_args
from sft.errors import ConfigError
from tests.helpers.families import tiny_config

ZERO2 = os.path.join(os.path.dirname(__file__), "..", "..", "..", "finetune", "ds_config_zero2.json")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for family in ("qwen3_moe", "qwen3_5_text"):  # 8 routed experts per layer / none
        out[family] = str(tmp_path_factory.mktemp(family))
        tiny_config(family, vocab_size=128).save_pretrained(out[family])
    return out


@pytest.mark.parametrize("family,size,extra,worlds,refusal", [
    ("qwen3_moe", 2, [], [2, 4], None),
    ("qwen3_moe", 2, [], [3], "--expert_parallel_size 2: does not divide the world size 3"),
    ("qwen3_moe", 3, [], [3], "--expert_parallel_size 3: does not divide the model's 8 routed experts per layer"),
    ("qwen3_5_text", 2, [], [2], "the model .* has no routed experts"),
    ("qwen3_moe", 2, ["--deepspeed", ZERO2], [2], "with --deepspeed .*: the engine reduces or shards every gradient"),
    ("qwen3_moe", 2, ["--fsdp", "full_shard"], [2], "with --fsdp: the engine"),
    ("qwen3_moe", 2, ["--sequence_parallel_size", "2"], [2], None),  # composed (docs/moe.md)
    ("qwen3_moe", 2, ["--q_lora", "True"], [2], "with --q_lora True: 4-bit experts are not cut"),
    ("qwen3_moe", 0, [], [2], "--expert_parallel_size 0: must be at least 1"),
])
def test_refusals_in_one_line(folders, tmp_path, family, size, extra, worlds, refusal):
    m, d, t, lora = parse_args(["--model_name_or_path", folders[family], "--output_dir", str(tmp_path / "out"),
                                "--use_lora", "True", "--expert_parallel_size", str(size), *extra])
    problems = expert_parallel_problems(m, t, lora, worlds)
    if refusal is None:
        assert problems == []
        launch_shape(m, t, worlds)
        return
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert re.search(refusal, problems[0]), problems[0]
    if "world size" in refusal:  # the launcher's check, before torchrun starts: the ranks' own words
        with pytest.raises(ConfigError) as e:
            launch_shape(m, t, worlds)
        assert e.value.problems == problems


@pytest.mark.parametrize("world,size,rank,expected", [
    (4, 2, 3, (1, [2, 3], [1, 3])),  # group of consecutive ranks; the replicas keep the same experts (r, r + N)
    (8, 4, 5, (1, [4, 5, 6, 7], [1, 5])),
    (2, 2, 0, (0, [0, 1], [0])),  # W == N: one replica, nothing summed
])
def test_groups_are_consecutive_ranks_and_replicas_are_strided(world, size, rank, expected):
    from sft.distributed.expert_parallel import ExpertParallel, layout

    assert layout(world, rank, size) == expected
    assert ExpertParallel(size=size, rank=expected[0], world_size=world).experts(128) == (expected[0] * 128 // size,
                                                                                         128 // size)


@pytest.mark.parametrize("family,size,refusal", [("qwen3_5_text", 2, "has no routed experts"),
                                                 ("qwen3_moe", 3, "does not divide the model's 8 routed experts")])
def test_the_loaded_model_refuses_too(family, size, refusal):
    """Where validation could not read the config, the loaded model's cut says the same in one line (exit 2)."""
    from sft.distributed.expert_parallel import ExpertParallel
    from sft.model.expert_parallel import spread_experts
    from tests.helpers.families import tiny_model

    with pytest.raises(ConfigError, match=refusal) as e:
        spread_experts(tiny_model(family, vocab_size=128), ExpertParallel(size=size, rank=0, world_size=size))
    assert len(e.value.problems) == 1 and e.value.exit_code == 2
