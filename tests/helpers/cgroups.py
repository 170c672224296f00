"""Memory cgroups for tests and benchmarks (root): run processes each capped at its own memory limit, as if each had
a device or a machine of that size, so that the memory plan reads the limit (sft.train.host_memory) and the kernel
enforces it. cgroup v1's memory controller where it is mounted (this project's machines), else cgroup v2."""
from __future__ import annotations

import os
import subprocess


def memory_cgroup(name: str, limit: int) -> tuple[str, str]:
    """A new memory cgroup ``name`` capped at ``limit`` bytes: ``(folder, file to write a pid into)``; cgroup v1's
    memory controller where it is mounted, else cgroup v2 (the memory controller enabled below the mount's root).
    Raises OSError where neither can be made (not root, no cgroup file system)."""
    mounts = [ln.split(" - ") for ln in open("/proc/self/mountinfo").read().splitlines() if " - cgroup" in ln]
    v1 = next((left.split()[4] for left, right in mounts if right.split()[0] == "cgroup"
               and "memory" in right.split()[2].split(",")), None)
    if v1:
        folder = os.path.join(v1, name)
        os.makedirs(folder)
        with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        return folder, os.path.join(folder, "cgroup.procs")
    v2 = next((left.split()[4] for left, right in mounts if right.split()[0] == "cgroup2"), None)
    if not v2:
        raise OSError("no cgroup file system is mounted")
    with open(os.path.join(v2, "cgroup.subtree_control"), "w") as f:
        f.write("+memory")
    folder = os.path.join(v2, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "memory.max"), "w") as f:
        f.write(str(limit))
    return folder, os.path.join(folder, "cgroup.procs")


def run_in_memory_cgroups(cmds: list[list[str]], limit: int, env: dict, cwd: str) -> tuple[int, str]:
    """Run each command (at once, in ``cwd``) in a memory cgroup of its own capped at ``limit`` bytes, as if each had
    a machine or a device of that size; ``(first non-zero exit code or 0, their outputs joined)``. The processes are
    killed if still running and the cgroups removed at the end. Raises OSError where no cgroup can be made."""
    made, procs = [], []
    try:
        for i, cmd in enumerate(cmds):
            folder, tasks = memory_cgroup(f"sft-test-{os.getpid()}-{i}", limit)
            made.append(folder)

            def enter(tasks=tasks):
                with open(tasks, "w") as f:
                    f.write(str(os.getpid()))

            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                          cwd=cwd, preexec_fn=enter))
        logs = [p.communicate()[0] for p in procs]
        codes = [p.returncode for p in procs]
        return next((c for c in codes if c != 0), 0), "\n".join(logs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for folder in made:
            try:
                os.rmdir(folder)
            except OSError:
                pass
