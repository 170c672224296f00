"""The package's layering rules, read from the source: no sys.path edits, the library never imports an entry
script, thin entry scripts (the error policy lives in sft.policy), console scripts, module sizes, package data.
The rules that need a fresh interpreter (what an import pulls in, what parsing starts) are in
tests/integration/test_layering.py."""
import os
import re

import pytest

from tests.helpers.paths import ROOT


def test_no_sys_path_edits_and_library_never_imports_entry_scripts():
    edits = ("sys.path." + "insert", "sys.path." + "append")  # spelled in two parts so that this file does not match
    offenders = []
    for top in ("sft", "tests", "scripts", "bench", "finetune.py"):
        paths = [os.path.join(ROOT, top)] if top.endswith(".py") else [
            os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, top)) for f in fs
            if f.endswith((".py", ".sh"))]
        for path in paths:
            text = open(path, encoding="utf-8").read()
            if any(e in text for e in edits):
                offenders.append(os.path.relpath(path, ROOT))
            if path.startswith(os.path.join(ROOT, "sft")) and \
                    re.search(r"^\s*(import finetune|from finetune)", text, re.M):
                offenders.append(os.path.relpath(path, ROOT) + " imports finetune.py")
    assert offenders == []


def test_modules_stay_small_unless_they_say_why():
    big = []
    for d, _, fs in os.walk(os.path.join(ROOT, "sft")):
        for f in fs:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                text = open(path, encoding="utf-8").read()
                if text.count("\n") > 420 and "over 400 lines because" not in text:
                    big.append((os.path.relpath(path, ROOT), text.count("\n")))
    assert big == []


ENTRY_POINTS = {  # file -> what it must call
    "finetune.py": "train_main", "scripts/merge_adapter.py": '"merge_main"', "scripts/generate.py": '"generate_main"',
    "scripts/show_sample.py": '"show_sample_main"', "scripts/ray_train.py": '"sft.ray.driver", "main"',
}


@pytest.mark.parametrize("path", sorted(ENTRY_POINTS))
def test_entry_scripts_are_thin(path):
    """An entry script runs one function and exits with its code (the scripts/ ones through scripts/_entry.py, whose
    only handled error is a Python without the sft package: the policy in sft.policy cannot report that)."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    code = [ln for ln in text.split('"""', 2)[-1].splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert ENTRY_POINTS[path] in text and len(code) <= 6, code
    assert "except" not in text, text


def test_console_scripts_name_the_cli_functions():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert set(scripts) == {"sft-train", "sft-check", "sft-ray", "sft-merge", "sft-export", "sft-generate",
                            "sft-show-sample"}
    import importlib

    for target in scripts.values():
        module, fn = target.split(":")
        assert callable(getattr(importlib.import_module(module), fn)), target


def test_shipped_deepspeed_configs_are_package_data():
    from sft.config.deepspeed import EXAMPLE, SHIPPED

    for name in ("ds_config_zero2.json", "ds_config_zero3.json", "ds_config_zero3_offload.json"):
        assert os.path.isfile(os.path.join(SHIPPED, name))
        link = os.path.join(ROOT, "finetune", name)  # Qwen's paths keep working
        assert os.path.realpath(link) == os.path.realpath(os.path.join(SHIPPED, name))
    assert os.path.isfile(EXAMPLE)


def test_shipped_fsdp_configs_are_package_data():
    from sft.config.fsdp import EXAMPLE, SHIPPED

    for name in ("fsdp_config_full_shard.json", "fsdp_config_full_shard_offload.json"):
        assert os.path.isfile(os.path.join(SHIPPED, name))
        link = os.path.join(ROOT, "finetune", name)
        assert os.path.islink(link) and os.path.realpath(link) == os.path.realpath(os.path.join(SHIPPED, name))
    assert os.path.isfile(EXAMPLE)


def test_every_relative_import_resolves():
    """Function-level imports run only on their path (the Ray stop poller's, a Q-LoRA run's): after modules move
    between packages, a stale ``from .x import y`` would fail only there, so every one is resolved here."""
    import ast
    import importlib
    import pathlib

    broken = []
    for path in sorted(pathlib.Path(ROOT, "sft").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        package = list(parts if path.name == "__init__.py" else parts[:-1])
        if path.name == "__init__.py":
            package = package[:-1] + [package[-1]] if package[-1] != "__init__" else package[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            target = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            try:
                module = importlib.import_module(target)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        importlib.import_module(f"{target}.{alias.name}")
            except ImportError as e:
                broken.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}: {e}")
    assert broken == []
