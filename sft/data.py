"""Read and validate conversation records.

Accepted files: a JSON file holding a list of records, or JSONL (one record per line). Files are
always read as UTF-8; a leading BOM is accepted.

Record forms (both may be mixed in one file):

* Qwen: ``{"id": ..., "conversations": [{"from": "user"|"assistant"|"system", "value": str}, ...]}``
  with the aliases ``human`` -> user and ``gpt`` -> assistant.
* OpenAI: ``{"id": ... (optional), "messages": [{"role": ..., "content": str}, ...]}``.

Rules: an optional leading system turn, then turns alternating user, assistant, ... starting with
user and ending with assistant (at least one assistant turn). Every value is a non-empty string.

The output of this module is a list of :class:`Conversation` with roles normalised to
``system``/``user``/``assistant``; nothing downstream looks at the raw records again.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from .errors import DataError

logger = logging.getLogger(__name__)

ROLE_ALIASES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
FORMS = {"conversations": ("from", "value"), "messages": ("role", "content")}
MAX_PROBLEMS_SHOWN = 20


@dataclass
class Conversation:
    """One validated record. ``messages`` is a list of ``{"role", "content"}`` dicts (roles normalised)."""

    id: str
    index: int
    messages: list[dict[str, str]]


@dataclass
class Problem:
    """One reason a record cannot be used, with where it is and how to fix it."""

    file: str
    index: Optional[int]  # 0-based record index (JSONL: counts non-blank lines)
    record_id: Optional[str]
    what: str
    fix: str
    turn: Optional[int] = None
    kind: str = "invalid"

    def __str__(self) -> str:
        where = [self.file]
        if self.index is not None:
            where.append(f"record {self.index}")
        if self.record_id is not None:
            where.append(f"id={self.record_id!r}")
        if self.turn is not None:
            where.append(f"turn {self.turn}")
        return f"{', '.join(where)}: {self.what}; {self.fix}"


def _decode(path: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: line {line} (byte {e.start}): bytes that are not UTF-8 ({raw[e.start:e.start + 4]!r}); "
                        "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def read_raw_records(path: str) -> tuple[list[tuple[int, Any]], list[Problem]]:
    """Read ``path`` into ``[(index, record)]`` without checking the records' contents.

    The format is decided by the content, not the file name: a file starting with ``[`` is a JSON
    list; one starting with ``{`` is a single JSON record or, if it holds more, JSONL. In JSONL an
    unparsable or undecodable line is a :class:`Problem` of that record (so ``skip`` can drop it); in a
    JSON list a syntax error stops everything.

    Raises:
        DataError: missing file, directory, empty file, not JSON, JSON syntax error in a list file,
            wrong top-level type, or bytes that are not UTF-8 in a list file.
    """
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory; give a .json or .jsonl file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}); check the path and permissions") from None
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(f"{path}: the file is UTF-16; re-save it as UTF-8 (e.g. iconv -f utf-16 -t utf-8)")
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if not raw.strip():
        raise DataError(f"{path}: the file is empty; it must hold a JSON list of records or JSONL lines")
    head = raw.lstrip()[:1]
    if head == b"{":
        try:
            return _top_level(path, _json_loads(path, raw.decode("utf-8"))), []
        except (UnicodeDecodeError, DataError):
            lines = [x for x in raw.split(b"\n", 64)[:64] if x.strip()]
            # JSONL: the first line looks like a whole object and some early line is one (a pretty-printed
            # object starts with a lone "{" and is reported with its own syntax error below)
            if len(lines) > 1 and lines[0].strip().endswith(b"}") and any(_parses(x) for x in lines[:8]):
                return _read_jsonl(path, raw)
            _json_loads(path, _decode(path, raw))  # one (pretty-printed) object: report its own syntax error
    if head != b"[":
        raise DataError(f"{path}: does not start with '[' or '{{', so it is neither a JSON list nor JSONL; "
                        "write a JSON list of records or one JSON object per line")
    return _top_level(path, _json_loads(path, _decode(path, raw))), []


def _json_loads(path: str, text: str, where: str = "") -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: {where}line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}); fix the syntax") from None
    except RecursionError:
        raise DataError(f"{path}: {where}JSON nested too deeply to read; records are objects holding a list of turns") from None


def _parses(line: bytes) -> bool:
    try:
        json.loads(line.decode("utf-8"))
        return True
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False


def _top_level(path: str, data: Any) -> list[tuple[int, Any]]:
    if isinstance(data, dict):
        return [(0, data)]  # one JSON object = one record (a one-line JSONL file, or a pretty-printed record)
    if not isinstance(data, list):
        raise DataError(f"{path}: the top level is a JSON {type(data).__name__}; it must be a list of records "
                        '[{"id": ..., "conversations": [...]}, ...] (or JSONL, one record per line)')
    if not data:
        raise DataError(f"{path}: the list holds no records")
    return list(enumerate(data))


def _read_jsonl(path: str, raw: bytes) -> tuple[list[tuple[int, Any]], list[Problem]]:
    problems: list[Problem] = []
    records: list[tuple[int, Any]] = []
    index = 0
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append(Problem(path, index, None, f"line {lineno}: bytes that are not UTF-8 "
                                    f"(at column {e.start + 1})", "re-save the file as UTF-8", kind="not UTF-8"))
            index += 1
            continue
        try:
            records.append((index, json.loads(text)))
        except json.JSONDecodeError as e:
            problems.append(Problem(path, index, None, f"line {lineno}, column {e.colno}: not valid JSON ({e.msg})",
                                    "each line must be one complete JSON object", kind="bad JSON"))
        except RecursionError:
            problems.append(Problem(path, index, None, f"line {lineno}: JSON nested too deeply to read",
                                    "a record is an object holding a list of turns", kind="bad JSON"))
        index += 1
    return records, problems


def normalize_record(path: str, index: int, rec: Any) -> Conversation | list[Problem]:
    """Check one record; return a :class:`Conversation` or the list of its problems."""
    if not isinstance(rec, dict):
        return [Problem(path, index, None, f"the record is a JSON {type(rec).__name__}, not an object",
                        'write it as {"id": ..., "conversations": [{"from": ..., "value": ...}]}', kind="not an object")]
    rid = rec.get("id")
    rid = None if rid is None else str(rid)
    forms = [k for k in FORMS if k in rec]
    if not forms:
        return [Problem(path, index, rid, "missing key 'conversations' (or 'messages')",
                        'add "conversations": [{"from": "user", "value": ...}, {"from": "assistant", "value": ...}]',
                        kind="missing key")]
    if len(forms) == 2:
        return [Problem(path, index, rid, "has both 'conversations' and 'messages'", "keep only one of them",
                        kind="ambiguous")]
    form = forms[0]
    role_key, text_key = FORMS[form]
    turns = rec[form]
    if not isinstance(turns, list):
        return [Problem(path, index, rid, f"'{form}' is a {type(turns).__name__}, not a list", f"make '{form}' a list of turns",
                        kind="bad type")]
    if not turns:
        return [Problem(path, index, rid, f"'{form}' is empty", "add at least a user turn and an assistant turn",
                        kind="empty conversation")]
    problems: list[Problem] = []
    messages: list[dict[str, str]] = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            problems.append(Problem(path, index, rid, f"the turn is a {type(turn).__name__}, not an object",
                                    f'write it as {{"{role_key}": ..., "{text_key}": ...}}', t, kind="bad type"))
            continue
        role, text = turn.get(role_key), turn.get(text_key)
        for key, val in ((role_key, role), (text_key, text)):
            if key not in turn:
                other = f" (found keys: {', '.join(sorted(turn))})" if turn else ""
                problems.append(Problem(path, index, rid, f"missing key '{key}'{other}",
                                        f"'{form}' turns need '{role_key}' and '{text_key}'", t, kind="missing key"))
            elif not isinstance(val, str):
                problems.append(Problem(path, index, rid, f"'{key}' is {json.dumps(val)[:40]}, not a string",
                                        f"give '{key}' a string value", t, kind="not a string"))
        if not isinstance(role, str) or not isinstance(text, str):
            continue
        norm = ROLE_ALIASES.get(role.strip().lower())
        if norm is None:
            problems.append(Problem(path, index, rid, f"unknown role '{role}' in '{role_key}'",
                                    "use user, assistant or system (aliases: human, gpt)", t, kind="unknown role"))
            continue
        if not text.strip():
            problems.append(Problem(path, index, rid, f"empty '{text_key}' for role {norm}",
                                    "give the turn some text or remove it", t, kind="empty value"))
        elif not _encodable(text):
            problems.append(Problem(path, index, rid, f"'{text_key}' holds an unpaired UTF-16 surrogate (a \\ud800-"
                                    "\\udfff escape)", "fix the text's encoding", t, kind="invalid unicode"))
        messages.append({"role": norm, "content": text, "_turn": t})
    if problems:
        return problems
    return _check_order(path, index, rid, messages)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _check_order(path, index, rid, messages) -> Conversation | list[Problem]:
    body = messages[1:] if messages[0]["role"] == "system" else messages
    for pos, m in enumerate(body):
        expected = "user" if pos % 2 == 0 else "assistant"
        if m["role"] != expected:
            what = ("a system turn after the first turn" if m["role"] == "system"
                    else f"role {m['role']} where {expected} was expected (roles out of order)")
            return [Problem(path, index, rid, what, "turns must go [system,] user, assistant, user, assistant, ...; "
                            "merge consecutive turns of one speaker", m["_turn"], kind="roles out of order")]
    if not any(m["role"] == "assistant" for m in body):
        return [Problem(path, index, rid, "no assistant turn", "add the assistant's reply: only replies are trained",
                        kind="no assistant turn")]
    if body[-1]["role"] != "assistant":
        return [Problem(path, index, rid, "the last turn is from the user, so nothing after it is trained",
                        "remove the trailing user turn or add the assistant's reply", body[-1]["_turn"],
                        kind="roles out of order")]
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    return Conversation(id=rid if rid is not None else f"#{index}", index=index, messages=clean)


def _report_problems(path: str, problems: list[Problem], total: int, on_bad_record: str) -> None:
    """``error``: raise one DataError listing the problems; ``skip``: log counts per kind and the ids."""
    if not problems:
        return
    bad = sorted({(p.index if p.index is not None else -1, p.record_id) for p in problems}, key=lambda x: x[0])
    if on_bad_record == "error":
        shown = "\n".join(f"  - {p}" for p in problems[:MAX_PROBLEMS_SHOWN])
        more = f"\n  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more" if len(problems) > MAX_PROBLEMS_SHOWN else ""
        raise DataError(f"{path}: {len(bad)} invalid record(s) of {total}:\n"
                        f"{shown}{more}\nFix them, or pass --on_bad_record skip to train without them.")
    kinds = Counter(p.kind for p in problems)
    ids = ", ".join(rid if rid is not None else f"#{i}" for i, rid in bad[:50])
    logger.warning("%s: skipped %d invalid record(s) (%s); ids: %s%s", path, len(bad),
                   ", ".join(f"{k}: {n}" for k, n in kinds.most_common()), ids, " ..." if len(bad) > 50 else "")


def load_conversations(path: str, on_bad_record: str = "error") -> list[Conversation]:
    """Read and validate every record of ``path``.

    Args:
        on_bad_record: ``"error"`` raises listing the problems; ``"skip"`` drops bad records and logs a
            summary (counts per kind of problem, and the ids).

    Raises:
        DataError: the file cannot be read or parsed, a record is invalid (``error``), or no record is left.
    """
    raw, problems = read_raw_records(path)
    convs: list[Conversation] = []
    for index, rec in raw:
        out = normalize_record(path, index, rec)
        if isinstance(out, Conversation):
            convs.append(out)
        else:
            problems.extend(out)
    total = len(raw) + sum(1 for p in problems if p.kind in ("bad JSON", "not UTF-8"))
    _report_problems(path, problems, total, on_bad_record)
    if not convs:
        raise DataError(f"{path}: no valid record left")
    dup = [i for i, n in Counter(c.id for c in convs).items() if n > 1]
    if dup:
        logger.warning("%s: %d id(s) appear more than once (e.g. %s); all copies are trained on",
                       path, len(dup), ", ".join(map(repr, dup[:5])))
    return convs


def reject_control_tokens(convs: list[Conversation], control_tokens: list[str], path: str,
                          on_bad_record: str = "error") -> list[Conversation]:
    """Refuse text that spells a control token of the chat template (``<|im_end|>``, ``<|im_start|>`` ...).

    The tokenizer turns such text into the real special token, so a user turn could fake a new turn
    and a reply would train a stray end-of-turn token. ``skip`` drops those records (logged).

    Raises:
        DataError: with ``error``, listing every record, turn and token found.
    """
    problems = []
    for c in convs:
        for t, m in enumerate(c.messages):
            found = [tok for tok in control_tokens if tok in m["content"]]
            if found:
                problems.append(Problem(path, c.index, c.id, f"the {m['role']} text contains the control token(s) "
                                        f"{', '.join(found)}", "remove them or write them differently (they would "
                                        "become real chat-template tokens)", t, kind="control token in text"))
                break
    _report_problems(path, problems, len(convs), on_bad_record)
    bad = {p.index for p in problems}
    kept = [c for c in convs if c.index not in bad]
    if not kept:
        raise DataError(f"{path}: no valid record left")
    return kept


def file_sha256(path: str) -> str:
    """Hex sha256 of a file's bytes (used in the dataset cache key)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
