"""The launcher's check refuses the job shapes every rank would refuse (sft/app/check.py ``launch_shape``), with the
ranks' own rules and words."""
import types

import pytest

from sft.app.check import launch_shape
from sft.distributed.process_group import check_sequence_parallel_size
from sft.errors import ConfigError
from tests.helpers.families import tiny_config


def args(size: int, mode: str = "auto", model: str = "unused"):
    return (types.SimpleNamespace(model_name_or_path=model, trust_remote_code=False),
            types.SimpleNamespace(sequence_parallel_size=size, sequence_parallel_mode=mode, expert_parallel_size=1))


@pytest.mark.parametrize("size,worlds,refused_at", [(2, [3], 3), (4, [4, 6, 8], 6), (2, [2, 4], None),
                                                    (3, [], None), (1, [3], None)])
def test_sequence_parallel_size_against_every_world_size(size, worlds, refused_at):
    if refused_at is None:
        launch_shape(*args(size), worlds)
        return
    with pytest.raises(ConfigError) as e:
        launch_shape(*args(size), worlds)
    with pytest.raises(ConfigError) as rank:  # what each rank says at that world size
        check_sequence_parallel_size(size, refused_at)
    assert e.value.problems == rank.value.problems and len(e.value.problems) == 1


def test_ulysses_heads_refused_from_the_models_config(tmp_path):
    tiny_config("qwen3_moe", vocab_size=128).save_pretrained(tmp_path)  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match="4 attention heads are not divisible by 8"):
        launch_shape(*args(8, "ulysses", str(tmp_path)), [8])
    launch_shape(*args(8, "auto", str(tmp_path)), [8])  # auto: all_gather where ulysses cannot split the heads
    launch_shape(*args(2, "ulysses", str(tmp_path)), [2])
