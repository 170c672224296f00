"""Resume, atomic checkpoints and preemption (README "Resume and preemption"): the rules, in process
(completion marker, rotation, auto resume, signal handling, the seeded length-grouped order). The real runs
(the watchdog's exit, the kill-and-resume loops) are in tests/integration/train/test_resume.py.
"""
import os
import signal
from types import SimpleNamespace

import pytest

from sft.train import checkpoint as ck


def fake_checkpoint(out, step, complete=True, payload=b"w" * 100):
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text('{"global_step": %d}' % step)
    (path / "adapter_model.safetensors").write_bytes(payload)
    (path / "global_step" / "shard").parent.mkdir()
    (path / "global_step" / "shard").write_bytes(b"s" * 10)
    if complete:
        ck.mark_complete(str(path), {"world_size": 1})
    return str(path)


def targs(out, resume=None, overwrite=False, use_lora=True):
    """The values check_resume takes: (output_dir, resume_from_checkpoint, overwrite_output_dir, use_lora)."""
    return str(out), resume, overwrite, use_lora


def test_auto_takes_newest_complete_checkpoint_only(tmp_path):
    out = tmp_path / "out"
    two = fake_checkpoint(out, 2)
    three = fake_checkpoint(out, 3)
    fake_checkpoint(out, 10, complete=False)  # killed mid-write: no marker
    with open(os.path.join(three, "global_step", "shard"), "wb") as f:  # marked, then a file lost its tail
        f.write(b"s")
    (out / "checkpoint-11").write_text("not a folder")
    assert ck.is_complete(two) and not ck.is_complete(three)
    assert ck.latest_complete(str(out)) == two
    assert ck.resolve_resume(*targs(out)[:3]) == two  # unset = auto
    assert ck.resolve_resume(*targs(out, "auto")[:3]) == two
    assert ck.resolve_resume(*targs(out, "True")[:3]) == two  # Qwen-era scripts
    assert ck.resolve_resume(*targs(out, overwrite=True)[:3]) is None  # fresh start asked for
    assert ck.resolve_resume(*targs(out, "auto", overwrite=True)[:3]) == two  # explicit auto wins
    assert ck.resolve_resume(*targs(out, three)[:3]) == three  # an explicit path is used as given
    assert ck.resolve_resume(*targs(tmp_path / "missing")[:3]) is None
    # a marker that is not JSON / lists a missing file
    (out / "checkpoint-2" / ck.MARKER).write_text("{")
    assert ck.latest_complete(str(out)) is None


def test_rotation_keeps_newest_complete_and_best(tmp_path):
    out = tmp_path / "out"
    paths = {s: fake_checkpoint(out, s) for s in (1, 2, 3, 4, 5)}
    fake_checkpoint(out, 6, complete=False)
    deleted = ck.rotate(str(out), 2, best=paths[1])
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-5"]  # best + newest complete
    assert set(deleted) == {paths[2], paths[3], paths[4], str(out / "checkpoint-6")}
    assert ck.rotate(str(out), 1, best=paths[1]) == []  # both protected even with limit 1
    assert ck.rotate(str(out), 1, best=None) == [paths[1]]
    assert sorted(os.listdir(out)) == ["checkpoint-5"]
    assert ck.rotate(str(out), None, None) == [] and ck.rotate(str(out), 0, None) == []
    # only incomplete folders: nothing is complete, so nothing is deleted (the newest complete is unknown)
    only = tmp_path / "only"
    fake_checkpoint(only, 3, complete=False)
    assert ck.rotate(str(only), 1, None) == [] and os.listdir(only) == ["checkpoint-3"]


def test_removed_checkpoint_loses_its_marker_first(tmp_path, monkeypatch):
    path = fake_checkpoint(tmp_path, 4)

    def dies(*a, **k):  # rmtree killed right at the start: the folder must already be incomplete
        raise KeyboardInterrupt

    monkeypatch.setattr(ck.shutil, "rmtree", dies)
    with pytest.raises(KeyboardInterrupt):
        ck.remove_checkpoint(path)
    assert os.path.isdir(path) and not ck.is_complete(path)


def test_output_dir_rules_for_resume(tmp_path):
    out = tmp_path / "out"
    fake_checkpoint(out, 2, complete=False)  # a first save that was killed: start fresh, no complaint
    assert ck.check_resume(*targs(out)) == ([], True)
    fake_checkpoint(out, 1)
    assert ck.check_resume(*targs(out)) == ([], True)
    (out / "notes.txt").write_text("mine")  # complete checkpoint inside: resuming here is fine
    assert ck.check_resume(*targs(out)) == ([], True)
    assert ck.check_resume(*targs(out, overwrite=True))[1] is False  # fresh start into a non-empty folder
    problems, _ = ck.check_resume(*targs(out, str(out / "checkpoint-1"), use_lora=False))
    assert len(problems) == 1 and "holds a LoRA adapter, but this run trains the full model" in problems[0]
    full = tmp_path / "full" / "checkpoint-3"
    full.mkdir(parents=True)
    (full / "trainer_state.json").write_text("{}")
    (full / "model.safetensors").write_bytes(b"x")
    problems, _ = ck.check_resume(*targs(tmp_path / "new", str(full), use_lora=True))
    assert "holds a full model, but this run has --use_lora True" in problems[0]
    problems, ok = ck.check_resume(*targs(out, str(tmp_path / "nope")))
    assert "not a checkpoint folder (no trainer_state.json)" in problems[0] and not ok


def test_signal_sets_flag_and_all_ranks_stop_at_step_end(monkeypatch):
    from sft.train.preemption import PreemptionHandler

    h = PreemptionHandler(timeout_s=60)
    before = signal.getsignal(signal.SIGTERM)
    h.install()
    try:
        args, state = SimpleNamespace(device="cpu"), SimpleNamespace(global_step=7)
        control = SimpleNamespace(should_save=False, should_training_stop=False)
        h.on_step_end(args, state, control)
        assert not control.should_save and not h.preempted
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # repeated signals (torchrun forwards Ctrl-C again) are ignored
        assert h.signum == signal.SIGTERM
        h.on_step_end(args, state, control)
        assert control.should_save and control.should_training_stop and h.stopped_at == 7
        assert h._watchdog.is_alive()
    finally:
        h.uninstall()  # also cancels the watchdog, which would otherwise end this process with 75
    assert signal.getsignal(signal.SIGTERM) is before
    h._watchdog.join(5)
    assert not h._watchdog.is_alive()


def zero_shards(path, ranks):
    """DeepSpeed ZeRO optimizer shards (names as deepspeed 0.18 writes them) for ``ranks`` data-parallel ranks."""
    step = os.path.join(path, "global_step4")
    os.makedirs(step, exist_ok=True)
    for r in range(ranks):
        open(os.path.join(step, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"), "wb").close()
    open(os.path.join(step, "mp_rank_00_model_states.pt"), "wb").close()


def test_zero_checkpoint_at_another_world_size_is_refused_with_the_way_on(tmp_path):
    out = tmp_path / "out"
    path = fake_checkpoint(out, 4)
    assert ck.zero_world_size(path) is None  # no ZeRO shards: a DDP checkpoint resumes at any world size
    assert ck.check_zero_world_size(str(out), None, False, 2, 1) == []
    zero_shards(path, 3)
    assert ck.zero_world_size(path) == 3
    assert ck.check_zero_world_size(str(out), None, False, 3, 1) == []
    assert ck.check_zero_world_size(str(out), None, True, 2, 1) == []  # --overwrite_output_dir: a fresh start
    assert ck.check_zero_world_size(str(out), None, False, 2, 2) == []  # through a universal checkpoint
    assert ck.check_zero_world_size(str(out), None, False, 2, 3) == []
    [auto] = ck.check_zero_world_size(str(out), "auto", False, 2, 1)
    assert auto.startswith(f"--output_dir {out}: its newest complete checkpoint {path} was written by DeepSpeed "
                           "ZeRO at world size 3, but this run has world size 2: ZeRO stage 1's"), auto
    assert "run again with 3 processes in all" in auto and "--overwrite_output_dir True" in auto
    assert "ZeRO stages 2 and 3 and DDP, without --deepspeed, resume at another world size" in auto
    [named] = ck.check_zero_world_size(str(tmp_path / "new"), path, False, 1, 1)
    assert named.startswith(f"--resume_from_checkpoint {path} was written by DeepSpeed ZeRO at world size 3"), named


def test_validate_refuses_a_zero_resume_at_another_world_size_before_loading(tmp_path, tiny_model_dir, toy_data,
                                                                             monkeypatch):
    from sft.app.validation import validate
    from sft.config.arguments import parse_args
    from sft.errors import ConfigError

    out = tmp_path / "out"
    zero_shards(fake_checkpoint(out, 4), 3)
    args = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir", str(out),
                       "--use_lora", "True", "--deepspeed", '{"zero_optimization": {"stage": 1}, '
                       '"train_micro_batch_size_per_gpu": "auto"}', "--report_to", "none"])[:4]
    validate(*args)  # a lone process (sft-check before torchrun) does not know the job's world size
    monkeypatch.setenv("WORLD_SIZE", "3")
    validate(*args)
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun gives every rank of the smaller rerun
    with pytest.raises(ConfigError, match="written by DeepSpeed ZeRO at world size 3, but this run has world size 2"):
        validate(*args)


def shaped_checkpoint(out, step, world_size, micro_batch, grad_accum, with_global=True):
    path = fake_checkpoint(out, step, complete=False)
    info = {"world_size": world_size, "per_device_train_batch_size": micro_batch,
            "gradient_accumulation_steps": grad_accum}
    ck.mark_complete(path, {**info, "global_batch": world_size * micro_batch * grad_accum} if with_global else info)
    return path


def test_another_world_size_keeps_the_global_batch_or_is_refused_with_the_numbers(tmp_path):
    from sft.errors import ConfigError
    from sft.train.world_size import plan_world_size_change

    path = shaped_checkpoint(tmp_path / "out", 3, world_size=2, micro_batch=2, grad_accum=2)  # global batch 8
    one = plan_world_size_change(path, 1, 2, 2)
    assert (one.old_world_size, one.world_size, one.old_grad_accum, one.grad_accum, one.global_batch) == (2, 1, 2, 4, 8)
    assert one.line().startswith(f"resuming {path} (written at world size 2) at world size 1: gradient accumulation "
                                 "2 -> 4, so micro batch 2 x gradient accumulation 4 x world size 1 = global batch 8")
    four = plan_world_size_change(path, 4, 2, 2)
    assert four.grad_accum == 1 and "ranks 2..3 have no RNG file in the checkpoint" in four.line()
    assert plan_world_size_change(path, 2, 2, 2) is None  # the same world size: nothing recomputed
    assert plan_world_size_change(path, 1, 4, 2) is None  # another micro batch: the user's shape (warned on resume)
    assert plan_world_size_change(None, 1, 2, 2) is None
    with pytest.raises(ConfigError) as e:
        plan_world_size_change(path, 3, 2, 2)
    assert (f"resuming checkpoint {path}: it was written at world size 2 with micro batch 2 x gradient accumulation 2 "
            "x world size 2 = global batch 8; this run has world size 3, and 8 is not a multiple of micro batch 2 x "
            "world size 3 = 6") in str(e.value)
    assert "run with a world size (nodes x processes per node) of 1, 2, 4, or start afresh" in str(e.value)
    old = shaped_checkpoint(tmp_path / "old", 5, world_size=2, micro_batch=1, grad_accum=3, with_global=False)
    assert plan_world_size_change(old, 3, 1, 3).grad_accum == 2  # markers of older versions: global batch derived


def test_sequence_parallel_size_is_kept_on_resume_and_world_size_changes_count_groups(tmp_path):
    from sft.errors import ConfigError
    from sft.train.world_size import plan_world_size_change

    path = fake_checkpoint(tmp_path / "out", 4, complete=False)  # 4 ranks, groups of 2: 2 groups x 2 x 2 = 8
    ck.mark_complete(path, {"world_size": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                            "global_batch": 8, "sequence_parallel_size": 2})
    with pytest.raises(ConfigError) as e:
        plan_world_size_change(path, 4, 2, 2, sequence_parallel=1)
    assert str(e.value).count("\n  - ") == 1
    assert "written with --sequence_parallel_size 2, this run has 1; resume with --sequence_parallel_size 2" in \
        str(e.value)
    two = plan_world_size_change(path, 2, 2, 2, sequence_parallel=2)  # one group left: accumulation doubles
    assert (two.old_world_size, two.world_size, two.grad_accum, two.global_batch) == (2, 1, 4, 8)
    assert plan_world_size_change(path, 4, 2, 2, sequence_parallel=2) is None
    old = shaped_checkpoint(tmp_path / "old", 5, world_size=2, micro_batch=2, grad_accum=2)  # no size: 1
    with pytest.raises(ConfigError, match="written with --sequence_parallel_size 1, this run has 2"):
        plan_world_size_change(old, 2, 2, 2, sequence_parallel=2)


def test_the_same_command_at_the_checkpoints_world_size_keeps_the_accumulation_an_earlier_resume_set(tmp_path):
    """An elastic job (or any run resumed twice): started at world size 3 with accumulation 2 (global batch 6), resumed
    at 2 (accumulation 3), then resumed again at 2 by the same command (accumulation 2 as given). The checkpoint of
    world size 2 must be continued with accumulation 3, not the configured 2 (global batch 4: found by
    bench/fault_drill.py, whose next round at 3 nodes was then refused)."""
    from sft.config.settings import RunSettings
    from sft.train.world_size import plan_world_size_change

    path = fake_checkpoint(tmp_path / "out", 44, complete=False)
    settings = RunSettings(world_size=2, micro_batch=1, configured_grad_accum=2, grad_accum=3)
    info = ck.run_info(settings, seed=1, use_lora=True)
    assert (info["gradient_accumulation_steps"], info["configured_gradient_accumulation_steps"], info["global_batch"]) \
        == (3, 2, 6)
    ck.mark_complete(path, info)
    same = plan_world_size_change(path, 2, 1, 2)
    assert (same.old_world_size, same.world_size, same.old_grad_accum, same.grad_accum, same.global_batch) == \
        (2, 2, 2, 3, 6)
    assert same.line() == (f"resuming {path} at the world size 2 it was written at, with its gradient accumulation 3 "
                           "(set by an earlier resume at another world size) instead of the configured 2, so micro "
                           "batch 1 x gradient accumulation 3 x world size 2 = global batch 6 samples as configured; "
                           "optimizer, scheduler and data position carry over")
    assert plan_world_size_change(path, 3, 1, 2).grad_accum == 2  # back at 3 nodes
    assert plan_world_size_change(path, 2, 1, 3) is None  # configured as it trained: nothing to change
    assert plan_world_size_change(path, 2, 1, 4) is None  # another accumulation than configured: the user's choice
    old = shaped_checkpoint(tmp_path / "old", 5, world_size=2, micro_batch=1, grad_accum=3)  # a marker without it
    assert plan_world_size_change(old, 2, 1, 2) is None


def test_validate_refuses_a_world_size_that_cannot_keep_the_global_batch(tmp_path, tiny_model_dir, toy_data,
                                                                        monkeypatch, capsys):
    from sft.app.validation import validate
    from sft.cli import run_cli
    from sft.config.arguments import parse_args
    from sft.errors import ConfigError

    out = tmp_path / "out"
    shaped_checkpoint(out, 3, world_size=2, micro_batch=2, grad_accum=2)
    args = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir", str(out),
                       "--use_lora", "True", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                       "2", "--report_to", "none"])[:4]
    monkeypatch.setenv("WORLD_SIZE", "1")
    validate(*args)  # 8 = 2 x 4 x 1: kept
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="this run has world size 3, and 8 is not a multiple of micro batch 2"):
        validate(*args)
    capsys.readouterr()
    assert run_cli(lambda: validate(*args)) == 2  # the CLI policy: exit 2, one paragraph, no traceback
    err = capsys.readouterr().err
    assert "run with a world size (nodes x processes per node) of 1, 2, 4" in err and "Traceback" not in err


def test_a_resume_that_keeps_the_global_batch_is_not_warned_as_another_run_shape(tmp_path, caplog):
    path = shaped_checkpoint(tmp_path / "out", 3, world_size=2, micro_batch=2, grad_accum=2)
    now = {"world_size": 1, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "global_batch": 8}
    ck.warn_if_different(path, now)
    assert "different run shape" not in caplog.text
    ck.warn_if_different(path, {**now, "gradient_accumulation_steps": 2, "global_batch": 4})
    assert "different run shape (world_size 2 -> 1; global_batch 8 -> 4)" in caplog.text  # not kept: warned


def test_a_universal_checkpoint_is_reused_and_waited_for_with_a_bound(tmp_path):
    from sft.errors import ConfigError
    from sft.train.world_size import ensure_universal, universal_tag

    path = fake_checkpoint(tmp_path / "out", 4)
    with pytest.raises(ConfigError, match="rank 0's conversion to a DeepSpeed universal checkpoint did not finish "
                                          "within --ddp_timeout 0.2 s"):
        ensure_universal(path, rank=1, timeout_s=0.2, poll_s=0.05)  # rank 0 never converts: bounded, named
    (tmp_path / "out" / "checkpoint-4" / "latest_universal").write_text("global_step4_universal")
    assert universal_tag(path) is None  # names a folder that is not there: not complete
    os.mkdir(os.path.join(path, "global_step4_universal"))
    assert ensure_universal(path, rank=0, timeout_s=0.2) == "global_step4_universal"  # converted before: used as is
