"""Checkpoint integrity (docs/resume-and-preemption.md "Integrity"): the checksums in the completion marker, who hashes
which file, verification and the fallback of ``auto`` resume, the refusal of a named damaged checkpoint, rotation
that keeps a verified checkpoint, and the full-disk message. Real training runs with a flipped byte, a truncated file
and a full tmpfs are in tests/integration/train/test_checkpoint_integrity.py."""
import errno
import json
import logging
import os
from collections import namedtuple

import pytest

from sft.train import checkpoint as ck, integrity
from tests.helpers.files import flip_byte


def fake_checkpoint(out, step, ranks=1, complete=True):
    path = out / f"checkpoint-{step}"
    (path / "global_step").mkdir(parents=True)
    (path / "trainer_state.json").write_text('{"global_step": %d}' % step)
    (path / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 40)
    for r in range(ranks):
        (path / f"rng_state_{r}.pth").write_bytes(b"r%d" % r * 50)
        (path / "global_step" / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"z%d" % r * 70)
    if complete:
        ck.mark_complete(str(path), {"world_size": ranks})
    return str(path)




def truncate(path, by=1):
    os.truncate(path, os.path.getsize(path) - by)


def test_marker_records_size_and_checksum_of_every_file_and_verify_finds_a_flipped_byte(tmp_path):
    path = fake_checkpoint(tmp_path, 2, ranks=2)
    marker = json.load(open(os.path.join(path, ck.MARKER)))
    assert marker["hash"] == "xxh3_128" and marker["world_size"] == 2
    names = {"trainer_state.json", "adapter_model.safetensors", "rng_state_0.pth", "rng_state_1.pth",
             "global_step/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "global_step/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert set(marker["files"]) == names
    entry = marker["files"]["adapter_model.safetensors"]
    assert entry["size"] == 10240 and entry["xxh3_128"] == integrity.file_digest(os.path.join(path, "adapter_model."
                                                                                           "safetensors"))
    assert len(entry["xxh3_128"]) == 32 and ck.verify(path) is None
    flip_byte(os.path.join(path, "adapter_model.safetensors"))
    assert ck.is_complete(path)  # same size: only the checksum sees it
    why = ck.verify(path)
    assert why == ("adapter_model.safetensors: its xxh3_128 checksum differs from the one recorded when it was saved "
                   "(the bytes changed on disk)"), why


def test_verify_names_a_truncated_and_a_missing_file(tmp_path):
    path = fake_checkpoint(tmp_path, 2, ranks=2)
    truncate(os.path.join(path, "rng_state_1.pth"), by=3)
    assert ck.verify(path) == ("rng_state_1.pth (written by rank 1) has 97 bytes, the marker recorded 100 (truncated "
                               "or rewritten)")
    os.remove(os.path.join(path, "trainer_state.json"))
    assert ck.verify(path).startswith("rng_state_1.pth (written by rank 1) has 97 bytes")
    assert ck.verify(path).endswith("(and 1 more file(s))")
    assert ck.verify(path, rank=0, saver=True) == "trainer_state.json is missing"
    assert ck.verify(str(tmp_path / "nothing")).startswith("no completion marker")


def test_each_rank_hashes_and_verifies_the_files_it_wrote():
    assert integrity.owner_rank("rng_state_3.pth") == 3
    assert integrity.owner_rank("rng_state.pth") is None  # one process: the saver's
    assert integrity.owner_rank("global_step4/bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt") == 12
    assert integrity.owner_rank("global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt") == 1  # ZeRO-3
    assert integrity.owner_rank("global_step4/mp_rank_00_model_states.pt") is None
    assert integrity.owner_rank("pytorch_model_fsdp_0/__3_0.distcp") == 3  # FSDP2 sharded state
    assert integrity.owner_rank("optimizer_0/.metadata") is None
    assert integrity.owner_rank("optimizer.pt") is None and integrity.owner_rank("latest") is None


def test_marker_merges_the_ranks_checksums_and_lists_only_files_the_saver_sees(tmp_path):
    path = fake_checkpoint(tmp_path, 2, ranks=2, complete=False)
    (tmp_path / "checkpoint-2" / f".{ck.MARKER}.tmp").write_text("{")  # a marker write cut short: not listed
    (tmp_path / "checkpoint-2" / "global_step" / ".metadata").write_text("m")  # FSDP2's: listed
    skip = (ck.MARKER,)
    rank0 = integrity.hash_own_files(path, 0, True, skip)
    rank1 = integrity.hash_own_files(path, 1, False, skip)
    assert set(rank1) == {"rng_state_1.pth", "global_step/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert {e["rank"] for e in rank1.values()} == {1} and "trainer_state.json" in rank0
    assert not set(rank0) & set(rank1)
    # a node-local folder: rank 2's file lives on another node's disk, so this saver's marker leaves it out
    elsewhere = {"rng_state_2.pth": {"size": 5, "xxh3_128": "0" * 32, "rank": 2}}
    # rank 1's entry is used as given (not re-hashed here): a wrong recorded checksum shows up in verification
    rank1["rng_state_1.pth"] = {**rank1["rng_state_1.pth"], "xxh3_128": "f" * 32}
    files = ck.mark_complete(path, {}, {**rank0, **rank1, **elsewhere})
    assert "rng_state_2.pth" not in files and len(files) == 7 and "global_step/.metadata" in files
    assert ck.verify(path, rank=0, saver=True) is None  # rank 0 checks its own and the shared files only
    assert ck.verify(path, rank=1, saver=False).startswith("rng_state_1.pth (written by rank 1): its xxh3_128")


def test_auto_resume_falls_back_past_damaged_checkpoints_with_one_line_each(tmp_path, caplog, monkeypatch):
    out = tmp_path / "out"
    two = fake_checkpoint(out, 2)
    four = fake_checkpoint(out, 4)
    six = fake_checkpoint(out, 6)
    fake_checkpoint(out, 8, complete=False)  # killed mid-save: skipped without a word, as before
    flip_byte(os.path.join(six, "adapter_model.safetensors"))
    truncate(os.path.join(four, "global_step", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    with caplog.at_level(logging.WARNING, logger="sft"):
        assert ck.choose_resume(str(out), None, False) == two
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"not resuming from {six}: adapter_model.safetensors: its xxh3_128 checksum differs from the one recorded when "
        f"it was saved (the bytes changed on disk); resuming from the previous complete checkpoint {two} instead",
        f"not resuming from {four}: global_step/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt (written by rank 0) has "
        f"139 bytes, the marker recorded 140 (truncated or rewritten); resuming from the previous complete checkpoint "
        f"{two} instead"], lines
    caplog.clear()
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="sft"):
        full = ck.verify
        m.setattr(ck, "verify", lambda path, rank, saver: full(path))  # rank 1 of a two-rank job: both ranks find
        m.setattr(ck, "gather_objects", lambda obj: [obj, obj])  # the same problems (one rank's files would do as well)
        assert ck.choose_resume(str(out), "auto", False, rank=1, saver=False) == two
    assert caplog.records == []  # the same choice on rank 1, said once by global rank 0
    assert ck.choose_resume(str(out), None, True) is None  # --overwrite_output_dir: a fresh start
    assert ck.choose_resume(str(out), six, False) == six  # named: validation decides (refused there)
    assert ck.choose_resume(str(tmp_path / "empty"), None, False) is None
    flip_byte(os.path.join(two, "trainer_state.json"), offset=2)
    with pytest.raises(ck.CheckpointError, match=r"no checkpoint there passes verification \(.*checkpoint-6: .*"
                                                 r"checkpoint-4: .*checkpoint-2: trainer_state.json: its xxh3_128.*"
                                                 r"--overwrite_output_dir True"):
        ck.choose_resume(str(out), None, False)


def test_marker_without_checksums_from_an_older_sft_is_checked_by_size(tmp_path):
    path = fake_checkpoint(tmp_path, 3)
    marker = os.path.join(path, ck.MARKER)
    data = json.load(open(marker))
    data["files"] = {rel: e["size"] for rel, e in data["files"].items()}
    json.dump(data, open(marker, "w"))
    flip_byte(os.path.join(path, "adapter_model.safetensors"))
    assert ck.is_complete(path) and ck.verify(path) is None
    truncate(os.path.join(path, "adapter_model.safetensors"))
    assert "has 10239 bytes, the marker recorded 10240" in ck.verify(path)


def test_a_named_damaged_checkpoint_is_refused_a_named_unmarked_one_is_not(tmp_path):
    out = tmp_path / "out"
    path = fake_checkpoint(out, 4)
    assert ck.check_resume(str(tmp_path / "new"), path, False, True)[0] == []
    flip_byte(os.path.join(path, "adapter_model.safetensors"))
    problems, _ = ck.check_resume(str(tmp_path / "new"), path, False, True)
    assert problems == [f"--resume_from_checkpoint {path}: fails verification: adapter_model.safetensors: its xxh3_128 "
                        "checksum differs from the one recorded when it was saved (the bytes changed on disk); it "
                        "would not resume the run it saved; restore the file, name an earlier checkpoint-N, or pass "
                        "'auto' (the newest checkpoint in --output_dir that verifies)"]
    assert ck.check_resume(str(tmp_path / "new"), path, False, True, rank=1, saver=False)[0] == []  # not rank 1's file
    os.remove(os.path.join(path, ck.MARKER))  # written by another tool: resumed with a warning (warn_if_different)
    assert ck.check_resume(str(tmp_path / "new"), path, False, True)[0] == []


def test_validate_refuses_a_named_damaged_checkpoint_before_loading(tmp_path, tiny_model_dir, toy_data):
    from sft.app.validation import validate
    from sft.config.arguments import parse_args
    from sft.errors import ConfigError

    path = fake_checkpoint(tmp_path / "old", 4)
    truncate(os.path.join(path, "trainer_state.json"))
    args = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir",
                       str(tmp_path / "out"), "--use_lora", "True", "--resume_from_checkpoint", path,
                       "--report_to", "none"])[:4]
    with pytest.raises(ConfigError,
                       match="fails verification: trainer_state.json has 17 bytes, the marker recorded 18"):
        validate(*args)


def test_rotation_never_deletes_the_only_verified_checkpoint(tmp_path):
    out = tmp_path / "out"
    one = fake_checkpoint(out, 1)
    two = fake_checkpoint(out, 2)
    flip_byte(os.path.join(two, "adapter_model.safetensors"))  # complete by size, but damaged
    assert ck.rotate(str(out), 1, None) == []  # the newest complete and the newest verified (one) are both kept
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-2"]
    three = fake_checkpoint(out, 3)
    assert ck.rotate(str(out), 1, None, verified=three) == [one, two]
    assert os.listdir(out) == ["checkpoint-3"]


Usage = namedtuple("Usage", "total used free")


def test_out_of_space_is_recognised_from_each_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity.shutil, "disk_usage", lambda p: Usage(2 ** 30, 2 ** 30 - 2 ** 20, 2 ** 20))
    out = str(tmp_path)
    assert integrity.is_out_of_space(OSError(errno.ENOSPC, "No space left on device"), out)
    assert integrity.is_out_of_space(RuntimeError("Error while serializing: I/O error: No space left on device (os "
                                                  "error 28)"), out)  # safetensors
    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    torch_save.__context__ = RuntimeError("basic_ios::clear: iostream error")
    assert integrity.is_out_of_space(torch_save, out)  # no errno: counted because 1 MiB is left
    wrapped = ValueError("save failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert integrity.is_out_of_space(wrapped, out)
    assert not integrity.is_out_of_space(OSError(errno.EACCES, "Permission denied"), out)
    monkeypatch.setattr(integrity.shutil, "disk_usage", lambda p: Usage(2 ** 40, 2 ** 39, 2 ** 39))
    assert not integrity.is_out_of_space(torch_save, out)  # plenty of space: some other write failure


def test_a_sharded_save_on_a_full_disk_is_recognised_inside_torch_distributed_checkpoints_exception(tmp_path):
    """FSDP2's sharded checkpoints are written by torch.distributed.checkpoint, whose CheckpointException (a
    BaseException) wraps each rank's failure: here a real one, dcp.save into a 1 MiB tmpfs (root only)."""
    import subprocess
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            with pytest.raises(BaseException) as failed:
                dcp.save({"w": torch.zeros(1_000_000)}, checkpoint_id=str(mnt / "checkpoint-2"))
        assert integrity.is_checkpoint_failure(failed.value) and not isinstance(failed.value, Exception)
        assert integrity.is_out_of_space(failed.value, str(mnt))
        assert "out of disk space while writing" in integrity.out_of_space_message(failed.value, str(mnt), None)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    assert not integrity.is_checkpoint_failure(RuntimeError("not one"))


def test_out_of_space_message_names_the_file_the_space_and_the_checkpoint_kept(tmp_path, monkeypatch):
    out = tmp_path / "out"
    prev = fake_checkpoint(out, 2)
    monkeypatch.setattr(integrity.shutil, "disk_usage", lambda p: Usage(8 * 2 ** 20, 8 * 2 ** 20, 0))
    err = OSError(errno.ENOSPC, "No space left on device", str(out / "checkpoint-4" / "optimizer.pt"))
    msg = integrity.out_of_space_message(err, str(out), prev)
    assert msg.startswith(f"out of disk space while writing {out}/checkpoint-4/optimizer.pt: 0.0 MiB free of 8.0 MiB "
                          f"on the filesystem of --output_dir {out}; one checkpoint of this run takes 0.0 MiB"), msg
    assert f"the previous complete checkpoint {prev} is intact and the next start resumes from it" in msg
    assert msg.endswith("then run the same command again")
    partial = out / "checkpoint-4"
    partial.mkdir()
    (partial / "scheduler.pt").write_bytes(b"x")
    os.utime(partial / "scheduler.pt", (2 ** 31, 2 ** 31))  # the newest file: what was being written
    msg = integrity.out_of_space_message(RuntimeError("unexpected pos 5 vs 3"), str(out), None)
    assert f"while writing {partial}/scheduler.pt" in msg and "no checkpoint had been completed yet" in msg
