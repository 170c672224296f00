"""What the thin scripts in this folder share: run one function of the installed sft package and exit with its
code; a Python without the package is told how to get it (exit 2) instead of a ModuleNotFoundError traceback.
(The scripts import this file as their neighbour: Python puts a script's own folder first on sys.path.)"""
import importlib
import sys


def run(module: str, function: str, command: str) -> None:
    """``sys.exit(module.function())``; ``command``: the console script of the same job, named in the message."""
    try:
        main = getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as e:
        if e.name != "sft":
            raise
        print(f"error: this Python ({sys.executable}) has no package 'sft'; run `bash scripts/setup_env.sh` in the "
              f"repository once and use .venv/bin/python (or .venv/bin/{command}), or: pip install -e REPOSITORY",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
