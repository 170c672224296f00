"""sft/fsio.py: hashing (a file, a dataset folder), fsync, atomic writes and JSON reads."""
import hashlib
import json
import os
import socket

import pytest

from sft import fsio


def test_file_sha256_of_a_file_and_of_a_dataset_folder(tmp_path):
    data = os.urandom(3 * fsio.CHUNK + 17)  # several chunks and a partial one
    (tmp_path / "a.bin").write_bytes(data)
    assert fsio.file_sha256(str(tmp_path / "a.bin")) == hashlib.sha256(data).hexdigest()
    folder = tmp_path / "ds"
    (folder / "sub").mkdir(parents=True)
    (folder / "state.json").write_bytes(b"{}")
    (folder / "data-0.arrow").write_bytes(b"rows")
    (folder / "sub" / "ignored").write_bytes(b"not read")
    want = hashlib.sha256(b"data-0.arrow\0rows" + b"state.json\0{}").hexdigest()  # name order, name NUL bytes
    assert fsio.file_sha256(str(folder)) == want
    with pytest.raises(FileNotFoundError):
        fsio.file_sha256(str(tmp_path / "missing"))


def test_hash_file_feeds_any_hasher_chunk_by_chunk(tmp_path):
    (tmp_path / "f").write_bytes(b"abcdefg")
    fed = []

    class Recorder:
        def update(self, b):
            fed.append(b)

    fsio.hash_file(str(tmp_path / "f"), Recorder(), chunk=3)
    assert fed == [b"abc", b"def", b"g"]
    assert fsio.hash_file(str(tmp_path / "f"), hashlib.md5()).hexdigest() == hashlib.md5(b"abcdefg").hexdigest()


def test_atomic_write_replaces_in_order_and_leaves_no_temp_file(tmp_path, monkeypatch):
    path = str(tmp_path / "latest")
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", a, b)), real_replace(a, b))[1])
    fsio.atomic_write(path, "old")
    default_tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    assert calls == ["fsync", ("replace", default_tmp, path)]  # no folder fsync unless asked
    calls.clear()
    fsio.atomic_write(path, "é", tmp=str(tmp_path / ".latest.tmp"), sync_dir=True)
    assert calls == ["fsync", ("replace", str(tmp_path / ".latest.tmp"), path), "fsync"]  # file, rename, folder
    assert open(path, "rb").read() == "é".encode("utf-8") and os.listdir(tmp_path) == ["latest"]
    fsio.atomic_write(path, b"\x00\xff")
    assert open(path, "rb").read() == b"\x00\xff"


def test_atomic_write_json_has_json_dump_bytes_and_writes_nothing_unserializable(tmp_path):
    value = {"files": {"a": {"size": 3, "rank": None}}, "x": "é", "f": 1.5}
    for indent in (None, 1):
        path = tmp_path / f"m{indent}.json"
        fsio.atomic_write_json(str(path), value, indent=indent)
        with open(tmp_path / "ref", "w", encoding="utf-8") as f:
            json.dump(value, f, indent=indent)
        assert path.read_bytes() == (tmp_path / "ref").read_bytes()
        assert fsio.read_json(str(path)) == value
    with pytest.raises(TypeError):
        fsio.atomic_write_json(str(tmp_path / "bad.json"), {"x": object()})
    assert not [n for n in os.listdir(tmp_path) if n.startswith("bad")]


def test_fsync_file_and_dir(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    fsio.fsync_file(str(tmp_path / "f"))
    fsio.fsync_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        fsio.fsync_file(str(tmp_path / "missing"))
    with pytest.raises(NotADirectoryError):
        fsio.fsync_dir(str(tmp_path / "f"))

    def refuse(fd):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "fsync", refuse)  # a filesystem without fsync on folders (or a failing one)
    fsio.fsync_dir(str(tmp_path))  # ignored for a folder
    fsio.fsync_file(str(tmp_path / "f"), ignore_errors=True)
    with pytest.raises(OSError):
        fsio.fsync_file(str(tmp_path / "f"))


def test_read_json_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        fsio.read_json(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{bad")
    with pytest.raises(json.JSONDecodeError):
        fsio.read_json(str(tmp_path / "bad.json"))
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError):
        fsio.read_json(str(tmp_path / "bin.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    assert fsio.read_json(str(tmp_path / "list.json")) == [1, 2]
