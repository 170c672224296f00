"""The repository root, and the environment for subprocesses that import from it."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pythonpath_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) with the repository root first on PYTHONPATH, for a
    subprocess that imports ``tests.helpers``, ``sft`` or ``finetune`` while run from elsewhere (a program
    under torchrun, a generated ``python -c`` program, scripts/kill_resume_loop.py)."""
    env = dict(os.environ if env is None else env)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *rest])
    return env


def load_bench_module(name: str):
    """``bench/NAME.py`` loaded as a module (bench/ is a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
