"""Read and validate conversation records.

Accepted files: a JSON file holding a list of records, or JSONL (one record per line). Files are
always read as UTF-8; a leading BOM is accepted. The formats (JSON, JSONL, compressed, Parquet, datasets
folders) are read by :mod:`sft.data.records.sources`.

Record forms (both may be mixed in one file):

* Qwen: ``{"id": ..., "conversations": [{"from": "user"|"assistant"|"system"|"tool", "value": ...}, ...]}``
  with the aliases ``human`` -> user, ``gpt`` -> assistant, and LLaMA-Factory's ``function_call`` /
  ``observation``.
* OpenAI: ``{"id": ... (optional), "messages": [{"role": ..., "content": ...}, ...], "tools": [...] (optional)}``.
* Alpaca: ``{"instruction": str, "input": str (optional, may be empty), "output": str, "system": str (optional)}``:
  one user turn (the instruction, then a blank line and the input when there is one) and one assistant turn.

What a turn may hold (content parts, reasoning, tool calls and results, ``train`` / ``weight``) and the order of
turns (an optional leading system turn, then user, assistant, ...; tool results right after the assistant turn
whose calls they answer; the last turn from the assistant): :mod:`sft.data.records.messages`.

The output of this module is a stream of :class:`Conversation` with roles normalised to
``system``/``user``/``assistant``/``tool`` (:func:`iter_conversations`, memory bounded by the capped list of
problems); nothing downstream looks at the raw records again.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from sft.data.records.messages import (
    ROLE_ALIASES,
    ROLES_HELP,
    TurnProblem,
    message_text,
    normalize_tools,
    normalize_turn,
    results_in_call_order,
    structure_problem,
)
from sft.data.records.sources import Problem, iter_raw  # noqa: F401  (Problem re-exported: a record's problem)
from sft.data.refusal import refusal_of
from sft.errors import DataError

logger = logging.getLogger(__name__)

FORMS = {"conversations": ("from", "value"), "messages": ("role", "content")}
MAX_PROBLEMS_SHOWN = 20


@dataclass
class Conversation:
    """One validated record. ``messages`` is a list of message dicts (``{"role", "content"}`` plus, where the record
    has them, ``reasoning_content``, ``tool_calls``, ``tool_call_id``, ``name`` and ``"train": False``; roles
    normalised: :mod:`sft.data.records.messages`); ``tools`` the record's tool schemas in OpenAI's form, or None."""

    id: str
    index: int
    messages: list[dict]
    tools: Optional[list[dict]] = None


def normalize_record(path: str, index: int, rec: Any) -> Conversation | list[Problem]:
    """Check one record; return a :class:`Conversation` or the list of its problems."""
    if not isinstance(rec, dict):
        return [Problem(path, index, None, f"the record is a JSON {type(rec).__name__}, not an object",
                        'write it as {"id": ..., "conversations": [{"from": ..., "value": ...}]}',
                        kind="not an object")]
    rid = rec.get("id")
    rid = None if rid is None else str(rid)
    forms = [k for k in FORMS if k in rec]
    if not forms and ("instruction" in rec or "output" in rec):
        return _alpaca(path, index, rid, rec)
    bad = _form_problem(rec, forms)
    if bad is not None:
        what, fix, kind = bad
        return [Problem(path, index, rid, what, fix, kind=kind)]
    problems: list[Problem] = []
    messages: list[dict] = []
    tools = None
    if rec.get("tools") is not None:
        try:
            tools = normalize_tools(rec["tools"]) or None
        except TurnProblem as e:
            problems.append(Problem(path, index, rid, e.what, e.fix, kind=e.kind))
    for t, turn in enumerate(rec[forms[0]]):
        got = _turn_message(forms[0], turn)
        if isinstance(got, tuple):
            what, fix, kind = got
            problems.append(Problem(path, index, rid, what, fix, t, kind=kind))
        else:
            messages.append(dict(got, _turn=t))
    if problems:
        return problems
    bad = structure_problem(messages, tools)
    if bad is not None:
        what, fix, t, kind = bad
        return [Problem(path, index, rid, what, fix, None if t < 0 else t, kind=kind)]
    clean = results_in_call_order([{k: v for k, v in m.items() if k != "_turn"} for m in messages])
    return Conversation(id=rid if rid is not None else f"#{index}", index=index, messages=clean, tools=tools)


def _form_problem(rec: dict, forms: list) -> Optional[tuple[str, str, str]]:
    """``(what, fix, kind)`` where the record's turns (``forms``: which of :data:`FORMS` it has) are missing, doubled,
    not a list or empty; else None."""
    if not forms:
        return ("missing key 'conversations' (or 'messages')",
                'add "conversations": [{"from": "user", "value": ...}, {"from": "assistant", "value": ...}] '
                '(or an Alpaca record\'s "instruction" and "output")', "missing key")
    if len(forms) == 2:
        return "has both 'conversations' and 'messages'", "keep only one of them", "ambiguous"
    form = forms[0]
    turns = rec[form]
    if not isinstance(turns, list):
        return f"'{form}' is a {type(turns).__name__}, not a list", f"make '{form}' a list of turns", "bad type"
    if not turns:
        return f"'{form}' is empty", "add at least a user turn and an assistant turn", "empty conversation"
    return None


def _turn_message(form: str, turn: Any) -> dict | tuple[str, str, str]:
    """One turn of a record's ``form`` (a key of :data:`FORMS`) as a message
    (:func:`sft.data.records.messages.normalize_turn`),
    or ``(what, fix, kind)``: why it cannot be one."""
    role_key, text_key = FORMS[form]
    if not isinstance(turn, dict):
        return (f"the turn is a {type(turn).__name__}, not an object",
                f'write it as {{"{role_key}": ..., "{text_key}": ...}}', "bad type")
    role, text = turn.get(role_key), turn.get(text_key)
    if role_key not in turn:
        other = f" (found keys: {', '.join(sorted(turn))})" if turn else ""
        return f"missing key '{role_key}'{other}", f"'{form}' turns need '{role_key}' and '{text_key}'", "missing key"
    if not isinstance(role, str):
        return (f"'{role_key}' is {json.dumps(role)[:40]}, not a string", f"give '{role_key}' a string value",
                "not a string")
    alias = role.strip().lower()
    if alias not in ROLE_ALIASES:
        return f"unknown role '{role}' in '{role_key}'", ROLES_HELP, "unknown role"
    if text_key not in turn and not (ROLE_ALIASES[alias] == "assistant" and turn.get("tool_calls")):
        other = f" (found keys: {', '.join(sorted(turn))})" if turn else ""
        return f"missing key '{text_key}'{other}", f"'{form}' turns need '{role_key}' and '{text_key}'", "missing key"
    try:
        msg = normalize_turn(alias, text, turn, text_key)
    except TurnProblem as e:
        return e.what, e.fix, e.kind
    if not all(_encodable(x) for x in _texts(msg)):
        return (f"'{text_key}' holds an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape)",
                "fix the text's encoding", "invalid unicode")
    return msg


def _texts(msg: dict) -> list[str]:
    """Every text of a message a template may write: content, reasoning, tool call ids, names and arguments (as JSON),
    a tool result's ``tool_call_id`` and ``name``."""
    out = [message_text(msg)] + [msg[k] for k in ("reasoning_content", "tool_call_id", "name") if k in msg]
    for c in msg.get("tool_calls", ()):
        out += [c.get("id", ""), c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False)]
    return out


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _alpaca(path: str, index: int, rid: Optional[str], rec: dict) -> Conversation | list[Problem]:
    problems = []
    for key, required in (("instruction", True), ("output", True), ("input", False), ("system", False)):
        val = rec.get(key)
        if key not in rec:
            if required:
                problems.append(Problem(path, index, rid, f"missing key '{key}' (an Alpaca record needs 'instruction' "
                                        "and 'output')", f"add \"{key}\": ...", kind="missing key"))
        elif not isinstance(val, str):
            problems.append(Problem(path, index, rid, f"'{key}' is {json.dumps(val)[:40]}, not a string",
                                    f"give '{key}' a string value", kind="not a string"))
        elif required and not val.strip():
            problems.append(Problem(path, index, rid, f"empty '{key}'", f"give '{key}' some text", kind="empty value"))
        elif not _encodable(val):
            problems.append(Problem(path, index, rid, f"'{key}' holds an unpaired UTF-16 surrogate (a \\ud800-"
                                    "\\udfff escape)", "fix the text's encoding", kind="invalid unicode"))
    if problems:
        return problems
    user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input", "").strip() else "")
    messages = [{"role": "system", "content": rec["system"]}] if rec.get("system", "").strip() else []
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]
    return Conversation(id=rid if rid is not None else f"#{index}", index=index, messages=messages)


def _control_problem(path: str, conv: Conversation, control_tokens: Sequence[str]) -> Optional[Problem]:
    for t, m in enumerate(conv.messages):
        found = [tok for tok in control_tokens if any(tok in x for x in _texts(m))]
        if found:
            return Problem(path, conv.index, conv.id, f"the {m['role']} text contains the control token(s) "
                           f"{', '.join(found)}", "remove them or write them differently (they would become real "
                           "chat-template tokens)", t, kind="control token in text")
    if conv.tools:
        found = [tok for tok in control_tokens if tok in json.dumps(conv.tools, ensure_ascii=False)]
        if found:
            return Problem(path, conv.index, conv.id, f"'tools' contains the control token(s) {', '.join(found)}",
                           "remove them from the tool schemas", kind="control token in text")
    return None


def template_problem(path: str, conv: Conversation, err: Exception) -> Problem:
    """The chat template's refusal of one conversation (:func:`sft.data.encode.samples.encode_samples`) as its
    problem."""
    r = refusal_of(err)
    return Problem(path, conv.index, conv.id, r.what, r.fix, r.turn, kind=r.kind)


@dataclass
class RecordCheck:
    """What validating one source (or one shard of it) found; memory is capped, not per record.

    ``records`` counts every record read (valid or not), ``valid`` the conversations passed on; ``problems``
    keeps the first :data:`MAX_PROBLEMS_SHOWN` problems, ``bad_ids`` the first 50 bad records' ids (``#index``
    when a record has none), ``kinds`` counts problems per kind. A plain-JSON dict (:meth:`to_dict`) so that
    ranks can exchange it through the cache folder and :meth:`merge` the shards of one source.
    """

    path: str
    records: int = 0
    valid: int = 0
    n_bad: int = 0
    n_problems: int = 0
    problems: list = field(default_factory=list)
    bad_ids: list = field(default_factory=list)
    kinds: dict = field(default_factory=dict)

    def add(self, problems: list[Problem]) -> None:
        self.n_bad += 1
        self.n_problems += len(problems)
        self.problems += [(p.index if p.index is not None else -1, str(p))
                          for p in problems][:MAX_PROBLEMS_SHOWN - len(self.problems)]
        if len(self.bad_ids) < 50:
            p = problems[0]
            self.bad_ids.append((p.index if p.index is not None else -1,
                                 p.record_id if p.record_id is not None else f"#{p.index}"))
        for p in problems:
            self.kinds[p.kind] = self.kinds.get(p.kind, 0) + 1

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def merge(cls, path: str, parts: Sequence[dict]) -> "RecordCheck":
        """One check of the whole source from its shards' :meth:`to_dict` (problems and ids in record order)."""
        out = cls(path)
        for d in parts:
            for k in ("records", "valid", "n_bad", "n_problems"):
                setattr(out, k, getattr(out, k) + d[k])
            out.problems += [tuple(x) for x in d["problems"]]
            out.bad_ids += [tuple(x) for x in d["bad_ids"]]
            for k, n in d["kinds"].items():
                out.kinds[k] = out.kinds.get(k, 0) + n
        out.problems = sorted(out.problems, key=lambda x: x[0])[:MAX_PROBLEMS_SHOWN]
        out.bad_ids = sorted(out.bad_ids, key=lambda x: x[0])[:50]
        return out

    def error(self) -> Optional[DataError]:
        """The one error listing the problems (``--on_bad_record error``), or None when there are none."""
        if not self.n_bad:
            return None
        shown = "\n".join(f"  - {text}" for _, text in self.problems)
        more = (f"\n  ... and {self.n_problems - len(self.problems)} more"
                if self.n_problems > len(self.problems) else "")
        return DataError(f"{self.path}: {self.n_bad} invalid record(s) of {self.records}:\n{shown}{more}\n"
                         "Fix them, or pass --on_bad_record skip to train without them.")

    def finish(self, on_bad_record: str, log: bool = True) -> None:
        """``error``: raise :meth:`error`; ``skip``: log counts per kind and the ids. Then refuse an empty source.

        Raises:
            DataError: problems with ``error``, or no valid record left.
        """
        if self.n_bad and on_bad_record == "error":
            raise self.error()
        if self.n_bad and log:
            kinds = ", ".join(f"{k}: {n}" for k, n in Counter(self.kinds).most_common())
            ids = ", ".join(rid for _, rid in self.bad_ids)
            logger.warning("%s: skipped %d invalid record(s) (%s); ids: %s%s", self.path, self.n_bad, kinds, ids,
                           " ..." if self.n_bad > len(self.bad_ids) else "")
        if not self.valid:
            raise DataError(f"{self.path}: no valid record left")


def iter_conversations(path: str, check: RecordCheck, control_tokens: Sequence[str] = (), shard: int = 0,
                       n_shards: int = 1, stop_at_problem: bool = False) -> Iterator[Conversation]:
    """Validated conversations of shard ``shard`` of ``n_shards`` of ``path``, as a stream; every problem (the
    record's structure, and text that spells one of ``control_tokens``: the tokenizer would turn it into the
    real token, letting a user turn fake an assistant turn) is recorded in ``check``, never raised here.
    ``stop_at_problem``: stop after the first bad record's problems (a check that will fail anyway).

    Raises:
        DataError: file-level problems (see :func:`sft.data.records.sources.iter_raw`).
    """
    for item in iter_raw(path, shard, n_shards):
        check.records += 1
        if isinstance(item, Problem):
            out = [item]
        else:
            out = normalize_record(path, *item)
            if isinstance(out, Conversation):
                bad = _control_problem(path, out, control_tokens) if control_tokens else None
                if bad is None:
                    check.valid += 1
                    yield out
                    continue
                out = [bad]
        check.add(out)
        if stop_at_problem:
            return


def warn_duplicate_ids(path: str, ids: Sequence[str]) -> None:
    """Warn (:func:`log_duplicate_ids`) about the ids of ``path``'s records (``ids``) that appear more than once."""
    log_duplicate_ids(path, [i for i, n in Counter(ids).items() if n > 1])


def log_duplicate_ids(path: str, dup: Sequence[str]) -> None:
    """The one warning for ids that more than one record of ``path`` carries: ``dup``, those ids in the order found
    (the first 5 are named); nothing when ``dup`` is empty."""
    if dup:
        logger.warning("%s: %d id(s) appear more than once (e.g. %s); all copies are trained on",
                       path, len(dup), ", ".join(map(repr, dup[:5])))


def load_conversations(path: str, on_bad_record: str = "error",
                       control_tokens: Sequence[str] = ()) -> list[Conversation]:
    """Every valid record of ``path`` as a list (for tools that want a few records, e.g. ``sft-show-sample``;
    training streams them with :func:`iter_conversations`).

    Args:
        on_bad_record: ``"error"`` raises listing the problems; ``"skip"`` drops bad records and logs a
            summary (counts per kind of problem, and the ids).
        control_tokens: text forms of the chat template's special tokens, refused in any text.

    Raises:
        DataError: the file cannot be read or parsed, a record is invalid (``error``), or no record is left.
    """
    check = RecordCheck(path)
    convs = list(iter_conversations(path, check, control_tokens))
    check.finish(on_bad_record)
    warn_duplicate_ids(path, [c.id for c in convs])
    return convs
