"""What a memory cgroup still lets this process take (sft.train.host_memory), on cgroup file systems laid out in a
temporary folder as the kernel lays them out (v1 and v2, limits on the process's cgroup or one above it)."""
from __future__ import annotations

import os

from sft.train.host_memory import cgroup_room

GIB = 2 ** 30


def _cgroup(folder, files: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def _proc(tmp_path, cgroup_lines: list[str], mounts: list[str]) -> tuple[str, str]:
    cg, mi = tmp_path / "cgroup", tmp_path / "mountinfo"
    cg.write_text("\n".join(cgroup_lines) + "\n")
    mi.write_text("\n".join(f"{30 + n} 23 0:{40 + n} {m}" for n, m in enumerate(mounts)) + "\n")
    return str(cg), str(mi)


def test_v2_limit_above_the_process_counts_and_dropable_page_cache_is_not_used(tmp_path):
    root = tmp_path / "fs"
    _cgroup(root, {"memory.max": "max", "memory.current": str(20 * GIB)})
    _cgroup(root / "job_7", {"memory.max": str(4 * GIB), "memory.current": str(3 * GIB),
                            "memory.stat": f"anon {2 * GIB}\nfile {GIB}\ninactive_file {GIB // 2}\n"})
    _cgroup(root / "job_7" / "step_0", {"memory.max": "max", "memory.current": str(3 * GIB)})
    cg, mi = _proc(tmp_path, ["0::/job_7/step_0"], [f"/ {root} rw - cgroup2 cgroup2 rw"])
    assert cgroup_room(cg, mi) == (4 * GIB - (3 * GIB - GIB // 2), 4 * GIB)


def test_v1_memory_controller_takes_the_smallest_room_over_the_hierarchy(tmp_path):
    memory, cpu = tmp_path / "memory", tmp_path / "cpu"
    unlimited = str(9223372036854771712)
    _cgroup(memory, {"memory.limit_in_bytes": unlimited, "memory.usage_in_bytes": str(GIB)})
    _cgroup(memory / "slurm", {"memory.limit_in_bytes": str(8 * GIB), "memory.usage_in_bytes": str(7 * GIB),
                              "memory.stat": f"inactive_file 0\ntotal_inactive_file {GIB}\n"})
    _cgroup(memory / "slurm" / "uid_0", {"memory.limit_in_bytes": str(6 * GIB), "memory.usage_in_bytes": str(GIB),
                                         "memory.stat": "total_inactive_file 0\n"})
    _cgroup(cpu, {"memory.limit_in_bytes": str(GIB), "memory.usage_in_bytes": "0"})  # not the memory controller
    cg, mi = _proc(tmp_path, ["4:memory:/slurm/uid_0", "1:cpu:/slurm/uid_0"],
                   [f"/ {memory} rw - cgroup cgroup rw,memory", f"/ {cpu} rw - cgroup cgroup rw,cpu"])
    assert cgroup_room(cg, mi) == (2 * GIB, 8 * GIB)  # slurm: 8 - (7 - 1); uid_0: 6 - 1 = 5; the smaller


def test_no_limit_anywhere_or_no_cgroup_file_system_is_none(tmp_path):
    root = tmp_path / "fs"
    _cgroup(root / "a", {"memory.max": "max", "memory.current": str(GIB)})
    cg, mi = _proc(tmp_path, ["0::/a"], [f"/ {root} rw - cgroup2 cgroup2 rw"])
    assert cgroup_room(cg, mi) is None
    cg, mi = _proc(tmp_path, ["0::/a"], [f"/ {root} rw - tmpfs tmpfs rw"])
    assert cgroup_room(cg, mi) is None
    assert cgroup_room(str(tmp_path / "missing"), str(tmp_path / "missing")) is None


def test_cgroup_namespace_mount_root_is_the_process_own_cgroup(tmp_path):
    """In a container the mount shows the container's cgroup as its root; /proc/self/cgroup may name a path the
    mount does not show, or one under the mount's root."""
    root = tmp_path / "fs"
    _cgroup(root, {"memory.max": str(2 * GIB), "memory.current": str(GIB)})
    cg, mi = _proc(tmp_path, ["0::/kubepods/pod1/abc"], [f"/kubepods/pod1/abc {root} rw - cgroup2 cgroup2 rw"])
    assert cgroup_room(cg, mi) == (GIB, 2 * GIB)
    cg, mi = _proc(tmp_path, ["0::/"], [f"/kubepods/pod1/abc {root} rw - cgroup2 cgroup2 rw"])
    assert cgroup_room(cg, mi) == (GIB, 2 * GIB)


def test_usage_above_the_limit_leaves_nothing(tmp_path):
    root = tmp_path / "fs"
    _cgroup(root, {"memory.max": str(GIB), "memory.current": str(2 * GIB)})
    cg, mi = _proc(tmp_path, ["0::/"], [f"/ {root} rw - cgroup2 cgroup2 rw"])
    assert cgroup_room(cg, mi) == (0, GIB)


def test_the_plan_never_counts_more_than_the_cgroup_limit(monkeypatch):
    """Resident pages another cgroup was charged for (a model file cached earlier) are not in the cgroup's usage, so
    resident + free can exceed the limit: the limit, shared by the node's processes, bounds what the plan counts."""
    import torch

    from sft.train import memory_plan

    monkeypatch.setattr(memory_plan, "resident_bytes", lambda: 3 * GIB)
    monkeypatch.setattr(memory_plan, "cgroup_room", lambda: (4 * GIB, 5 * GIB))  # 1 GiB of the resident charged
    monkeypatch.setattr(memory_plan, "_kib_field", lambda path, key: 20 * GIB)
    held, available, what = memory_plan.held_and_available(torch.device("cpu"))
    assert (held, available) == (3 * GIB, 5 * GIB) and what == "memory cgroup limit"
    held, available, what = memory_plan.held_and_available(torch.device("cpu"), local_world_size=2)
    assert available == 5 * GIB // 2 and what == "memory cgroup limit / 2 processes on this node"
    monkeypatch.setattr(memory_plan, "cgroup_room", lambda: (GIB, 5 * GIB))  # others in the cgroup use the rest
    assert memory_plan.held_and_available(torch.device("cpu"))[1] == 4 * GIB
