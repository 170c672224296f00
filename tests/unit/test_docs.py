"""Every command in README.md and docs/*.md names things that exist.

Checked in fenced code blocks and in inline `code` spans:

* every path that starts with ``scripts/``, ``finetune/``, ``bench/``, ``docs/``, ``sft/``, ``tests/``, or is
  ``finetune.py``, exists in the repository (``*`` is a glob; placeholders such as ``MODEL_DIR`` are skipped);
* every ``--flag`` after a command that runs training (``finetune.py``, ``sft-train``, ``sft-check``,
  ``python -m sft train|check``, a ``finetune/finetune_*.sh`` preset, ``finetune/launch.sh``,
  ``scripts/run_example.sh``, ``bench/throughput.py``) is a field of the training dataclasses of
  ``sft.config.arguments`` (or ``--no_X`` for a boolean X, ``--config``, or one of the launcher's own flags);
  after a Ray command (``finetune/finetune_ray.sh``, ``scripts/ray_train.py``, ``sft-ray``) also a field of
  ``RayArguments`` or ``--preset``; after any other ``scripts/*.py`` or ``bench/*.py`` that defines its own
  argparse flags, a ``"--flag"`` string in that script's source;

and every markdown link to a local file resolves (with its ``#anchor``, when it points into a markdown file).
All problems are collected and reported at once as ``file:line: what is wrong``.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
PATH = re.compile(r"(?<![\w./$~-])((?:scripts|finetune|bench|docs|sft|tests)/[\w.*/-]*|finetune\.py(?![\w/-]))")
# a path with an all-caps segment (MODEL_DIR, PRESET), an ellipsis or <...> is a placeholder, not a file
PLACEHOLDER = re.compile(r"(?:^|/)[A-Z][A-Z0-9_]*(?:/|\.|$)|\.\.\.|…|<")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)")
COMMENT = re.compile(r"(?:^|\s)#.*$")

RAY_RUNNER = re.compile(r"(?<![\w-])(?:finetune_ray\.sh|ray_train\.py|sft-ray)(?![\w.-])")
PRESET_RUNNER = re.compile(r"(?<![\w-])(?:finetune_(?!ray\.sh)\w+\.sh|launch\.sh|run_example\.sh)(?![\w.-])")
TRAIN_RUNNER = re.compile(r"(?<![\w/.-])finetune\.py(?![\w.-])|(?<![\w-])sft-(?:train|check)(?![\w-])"
                          r"|(?<![\w-])-m\s+sft\s+(?:train|check)(?![\w-])|bench/throughput\.py(?![\w.-])")
SCRIPT_RUNNER = re.compile(r"(?<![\w./-])((?:scripts|bench)/\w+\.py)(?![\w.-])")

LAUNCHER_FLAGS = {"model", "data", "no_preflight", "help"}  # -m --model -d --data --no_preflight -h --help


def _train_flags() -> set[str]:
    from sft.config.arguments import DataArguments, LoraArguments, ModelArguments, TrainingArguments

    return _flags_of(ModelArguments, DataArguments, TrainingArguments, LoraArguments) | {"config", "help"}


def _ray_flags() -> set[str]:
    from sft.ray.flags import RayArguments

    return _flags_of(RayArguments) | {"preset"}


def _flags_of(*classes) -> set[str]:
    names = set()
    for cls in classes:
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            names.add(f.name)
            if "bool" in (f.type if isinstance(f.type, str) else repr(f.type)) or f.type is bool:
                names.add("no_" + f.name)
    return names


def _script_flags(script: str) -> set[str] | None:
    """``--flag`` strings of a script's own argparse, or None when it defines none (a thin wrapper)."""
    path = ROOT / script
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    if "add_argument" not in text:
        return None
    return set(re.findall(r"""["']--([A-Za-z][\w-]*)["']""", text)) | {"help"}


def _snippets(doc: Path):
    """Yield ``(line number, text, in_code_block)`` for every logical line of a fenced code block (backslash
    continuations joined) and every inline code span; and ``(line, link target, None)`` for every link."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    i, para, para_start = 0, [], 0

    def flush():
        text = "\n".join(para)
        starts = [0]
        for line in para:
            starts.append(starts[-1] + len(line) + 1)

        def line_of(offset):
            return para_start + max(k for k, s in enumerate(starts) if s <= offset) + 1

        spans = list(CODE_SPAN.finditer(text))
        for m in spans:
            yield line_of(m.start()), m.group(2).replace("\\|", "|").replace("\n", " "), False
        outside = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)
        for m in LINK.finditer(outside):
            yield line_of(m.start()), m.group(1), None

    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence:
            if para:
                yield from flush()
                para = []
            mark = fence.group(1)
            i += 1
            logical, logical_start = "", None
            while i < len(lines) and not lines[i].strip().startswith(mark[0] * len(mark)):
                line = lines[i]
                if logical_start is None:
                    logical_start = i
                if line.rstrip().endswith("\\"):
                    logical += line.rstrip()[:-1] + " "
                else:
                    yield logical_start + 1, logical + line, True
                    logical, logical_start = "", None
                i += 1
            if logical_start is not None:
                yield logical_start + 1, logical, True
            i += 1
            continue
        if lines[i].strip():
            if not para:
                para_start = i
            para.append(lines[i])
        elif para:
            yield from flush()
            para = []
        i += 1
    if para:
        yield from flush()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](link) -> text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out, in_code = set(), False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_code:
            base = _slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _check_path(path: str) -> str | None:
    path = path.rstrip(".,:;)'\"")
    if not path or PLACEHOLDER.search(path):
        return None
    if "*" in path:
        return None if glob.glob(str(ROOT / path)) else f"no file matches {path}"
    return None if (ROOT / path).exists() else f"no such file or folder: {path}"


def _check_flags(text: str, train: set[str], ray: set[str]) -> list[str]:
    text = COMMENT.sub("", text)
    found = []
    # the first command on the line decides; at one position the more specific kind wins (list order)
    for priority, (regex, kind) in enumerate(((RAY_RUNNER, "ray"), (PRESET_RUNNER, "preset"),
                                              (TRAIN_RUNNER, "train"), (SCRIPT_RUNNER, "script"))):
        m = regex.search(text)
        if m:
            found.append((m.start(), priority, m.end(), kind, m.group(0)))
    if not found:
        return []
    _, _, end, kind, runner = min(found)
    if kind == "script":
        known = _script_flags(runner)
        if known is None:
            return []
        what = f"a flag of {runner} (its argparse)"
    elif kind == "ray":
        known = train | ray | LAUNCHER_FLAGS - {"no_preflight"}
        what = "a training flag, a Ray flag (RayArguments) or --preset"
    elif kind == "preset":
        known = train | LAUNCHER_FLAGS
        what = "a training flag or one of the launcher's"
    else:
        known = train
        what = "a training flag (sft.config.arguments dataclasses)"
    return [f"--{name} after {runner.strip()} is not {what}"
            for name in FLAG.findall(text[end:]) if name not in known]


def test_commands_in_docs_name_real_files_and_flags():
    train, ray = _train_flags(), _ray_flags()
    problems = []
    assert DOC_FILES[0].is_file() and len(DOC_FILES) > 1, "README.md and docs/*.md not found"
    for doc in DOC_FILES:
        rel = doc.relative_to(ROOT)
        for line, text, in_code in _snippets(doc):
            if in_code is None:  # a markdown link
                target = text
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (doc.parent / file_part).resolve() if file_part else doc
                if not dest.exists():
                    problems.append(f"{rel}:{line}: link to {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    problems.append(f"{rel}:{line}: link to {target}: no heading #{anchor} in "
                                    f"{os.path.relpath(dest, ROOT)}")
                continue
            for m in PATH.finditer(text):
                why = _check_path(m.group(1))
                if why:
                    problems.append(f"{rel}:{line}: {why}")
            problems += [f"{rel}:{line}: {p}" for p in _check_flags(text, train, ray)]
    assert not problems, f"{len(problems)} problem(s) in README.md / docs/:\n" + "\n".join(problems)
