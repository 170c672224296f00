"""The ``--config`` YAML file: read, checked against the flag names, and turned into command-line tokens so that
argparse converts and checks its values exactly like typed flags (the command line wins)."""
from __future__ import annotations

import json
import os
from typing import Optional

from sft.compat.transformers import parser_actions
from sft.errors import ConfigError


def split_config(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """Remove ``--config PATH`` / ``--config=PATH`` from argv; return (path, remaining argv)."""
    rest, path, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise ConfigError(["--config needs a file path: --config train.yaml"])
            path = argv[i + 1]
            i += 2
            continue
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
            if not path:
                raise ConfigError(["--config= has no file path: --config train.yaml"])
        else:
            rest.append(a)
        i += 1
    return path, rest


# Other tools' YAML keys for the same setting, read as this toolkit's flag: accelerate's / TRL's ParallelismConfig
# (sp_size), axolotl (sequence_parallel_degree, later context_parallel_size).
SYNONYMS = {"sp_size": "sequence_parallel_size", "sequence_parallel_degree": "sequence_parallel_size",
            "context_parallel_size": "sequence_parallel_size"}


def read_yaml(path: str, known: set[str]) -> dict:
    """The ``--config`` YAML file's mapping of flag: value (``known``: the flag names, for unknown-key messages);
    a key of :data:`SYNONYMS` is read as the flag it names.

    Raises:
        ConfigError: no such file, not a file, invalid YAML, not a mapping, or unknown keys.
    """
    import yaml

    if not path or not os.path.exists(path):
        raise ConfigError([f"--config {path}: no such file; give the path of a YAML file of flag: value pairs"])
    if not os.path.isfile(path):
        raise ConfigError([f"--config {path}: not a file (a directory?); give the path of a YAML file of flag: "
                           "value pairs"])
    try:
        with open(path, encoding="utf-8-sig") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"--config {path}:{where}: not valid YAML ({getattr(e, 'problem', e)}); "
                           "fix the syntax (flag: value, one per line)"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"--config {path}: not UTF-8 text (byte {e.start}); save it as UTF-8"]) from None
    except OSError as e:  # unreadable: permissions, an I/O error
        raise ConfigError([f"--config {path}: cannot be read ({e.strerror or e}); check the path and "
                           "permissions"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: top level is a {type(data).__name__}; it must be a mapping "
                           "of flag: value pairs"])
    for synonym, name in SYNONYMS.items():
        if synonym in data and name in known:
            if name in data:
                raise ConfigError([f"--config {path}: both '{synonym}' and '{name}' are given; keep '{name}'"])
            data[name] = data.pop(synonym)
    unknown = sorted(str(k) for k in data if not (isinstance(k, str) and k in known))
    if unknown:
        raise ConfigError([f"--config {path}: unknown key '{k}'"
                           + suggest(k, known) + "; remove it or use a finetune.py flag name" for k in unknown])
    return data


def suggest(name: str, known: set[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def yaml_to_argv(path: str, defaults: dict, parser) -> list[str]:
    """Turn YAML defaults into command-line tokens, so argparse converts and checks them exactly like typed flags
    (placed before the user's flags: the last occurrence of a flag wins)."""
    actions = {a.dest: a for a in parser_actions(parser)}
    argv, problems = [], []
    defaults = yaml_data_sources(path, defaults)
    for key, value in defaults.items():
        if value is None:
            continue  # null = keep the default
        many = actions[key].nargs in ("+", "*")
        if isinstance(value, dict):
            if not key.endswith(("_kwargs", "_config")) and key != "deepspeed":
                problems.append(f"--config {path}: '{key}' is a mapping; give a single value")
                continue
            value = json.dumps(value)  # transformers reads dict-valued flags as JSON text
        if isinstance(value, bool) and actions[key].type is str:
            problems.append(f"--config {path}: '{key}' is the YAML boolean {value}; quote it if you mean the text "
                            f"('{key}: \"{str(value).lower()}\"')")
            continue
        if isinstance(value, list):
            if not many:
                problems.append(f"--config {path}: '{key}' is a list; give a single value")
                continue
            if any(isinstance(v, (list, dict)) for v in value):
                problems.append(f"--config {path}: '{key}' must be a list of plain values")
                continue
            argv += [f"--{key}", *map(yaml_scalar, value)]
        else:
            argv += [f"--{key}", yaml_scalar(value)]
    if problems:
        raise ConfigError(problems)
    return argv


def yaml_data_sources(path: str, defaults: dict) -> dict:
    """YAML ``data_path`` as a list of ``{path: ..., weight: ...}`` mappings -> ``data_path`` + ``data_weights``."""
    sources = defaults.get("data_path")
    if not (isinstance(sources, list) and any(isinstance(x, dict) for x in sources)):
        return defaults
    bad = [x for x in sources if not (isinstance(x, dict) and set(x) <= {"path", "weight"} and "path" in x)]
    if bad:
        raise ConfigError([f"--config {path}: 'data_path' entries must all be mappings with 'path' and optionally "
                           f"'weight' (found {json.dumps(bad[0], default=str)[:80]})"])
    if defaults.get("data_weights") is not None:
        raise ConfigError([f"--config {path}: weights given both in 'data_path' and in 'data_weights'; keep one"])
    weighted = [x for x in sources if "weight" in x]
    if weighted and len(weighted) != len(sources):
        raise ConfigError([f"--config {path}: 'data_path': give every source a 'weight', or none"])
    out = dict(defaults, data_path=[x["path"] for x in sources])
    if weighted:
        out["data_weights"] = [x["weight"] for x in sources]
    return out


def yaml_scalar(v) -> str:
    return str(v) if not isinstance(v, bool) else ("True" if v else "False")
