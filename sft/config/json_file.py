"""Reading a JSON config given on the command line (``--deepspeed``, ``--fsdp_config``): a file or inline JSON,
with one-line problems instead of exceptions (checked by :func:`sft.app.validation.validate` before anything loads)."""
from __future__ import annotations

import importlib.resources
import json
import os
from typing import Optional

SHIPPED = str(importlib.resources.files("sft") / "config" / "shipped")  # the configs shipped as package data


def load_json_flag(option: str, value: str, a_kind: str, example: str) -> tuple[Optional[object], str, list[str]]:
    """Parse ``OPTION VALUE`` (e.g. ``--deepspeed``, ``--fsdp_config``): a file path, or inline JSON text (``{...}``,
    as a YAML mapping becomes). ``a_kind`` names the config in messages ("a DeepSpeed", "an FSDP");
    ``example`` is a shipped one.
    Returns ``(parsed or None, name for messages, problems)``; never raises for a bad file.
    """
    inline = value.lstrip().startswith("{")
    flag = f"{option} (inline JSON)" if inline else f"{option} {value}"
    if not inline:
        if not os.path.exists(value):
            what = (f"a symlink to the missing {os.readlink(value)}" if os.path.islink(value) else "no such file")
            shipped = os.path.join(SHIPPED, os.path.basename(value))
            if not os.path.isabs(value) and os.path.isfile(shipped):
                return None, flag, [f"{flag}: {what} (relative to the working directory {os.getcwd()}); the shipped "
                                    f"{os.path.basename(value)} is {shipped}"]
            return None, flag, [f"{flag}: {what}; give {a_kind} JSON config such as {example}"]
        if not os.path.isfile(value):
            return None, flag, [f"{flag}: not a file; give {a_kind} JSON config such as {example}"]
    try:
        if inline:
            return json.loads(value), flag, []
        with open(value, encoding="utf-8") as f:
            return json.load(f), flag, []
    except UnicodeDecodeError as e:
        return None, flag, [f"{flag}: not UTF-8 text (byte {e.start}); save it as UTF-8 JSON"]
    except json.JSONDecodeError as e:
        return None, flag, [f"{flag}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; fix the file "
                            f"({example} is a valid example)"]
    except RecursionError:
        return None, flag, [f"{flag}: JSON nested too deeply to be {a_kind} config; fix the file"]
    except OSError as e:
        return None, flag, [f"{flag}: cannot read the file ({e.strerror})"]
