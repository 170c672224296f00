#!/usr/bin/env python
"""The prepared samples of two commits side by side: input ids, labels and the report, byte for byte.

Cases (one JSON file per case, its sha256 in the folder's ``manifest.json``):

* ``corpus/``: every template of the real template corpus (:mod:`tests.helpers.template_corpus`) x every kind of
  conversation there (multi-turn with a system prompt, reasoning, tool round trip) x every way of preparing it
  (whole, ``--long_conversations`` split / truncate / refuse at a short length, ``--mask_history``,
  ``--allow_dropped_content``): each reply's samples (every field) or the refusal (its text, turn, what, fix, and
  the record problem it becomes), and the truncation report (its fields and its lines).
* ``forms/``: every form of record (Qwen ``conversations``, ``messages``, Alpaca, role aliases, reasoning in a field
  or in ``<think>``, tool calls and results, ``train`` / ``weight`` marks, system prompts, bad records) validated
  (the conversation or the problems) and prepared under a few templates of the corpus and the ChatML fallback.
* ``example/``: the built-in example (``scripts/prepare_example.py``: SmolLM2's tokenizer and the chitchat
  conversations) through the whole preparation of a run (:func:`sft.app.data.load_records`: sources, records,
  samples, shards; eager and ``--lazy_preprocess``) with ``--long_conversations`` split / truncate / refuse.

Only entry points that exist on both sides are used (``normalize_record``, ``encode_samples``, ``TruncationReport``,
``sft.app.data.load_records``, ...), found in the wing's stage folders (``sft.data.encode.samples``) or, in a tree from
before them, at its top (``sft.data.samples``: :func:`wing`); the tree whose ``sft`` runs is the first entry of
PYTHONPATH, checked.

Usage (from the repository root, with .venv/bin/python):
  python scripts/compare_samples.py --base bd8f322           # base in a temporary git worktree vs this tree
  python scripts/compare_samples.py --base bd8f322 --head HEAD   # ... vs a commit (its own temporary worktree)
  python scripts/compare_samples.py --dump DIR               # this tree's (PYTHONPATH's) cases into DIR
  python scripts/compare_samples.py --compare DIR_A DIR_B    # two dump folders
Exit 0 when every case is identical, 1 otherwise, 2 on bad use. The assets (template corpus, Qwen tokenizer,
the example) are this tree's: ``.cache/test-assets`` (``SFT_TEST_ASSETS``) and ``.cache/example``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 40  # short enough that most corpus conversations are split, truncated or refused
EXAMPLE_MAX_LEN = 128
EXAMPLE_RECORDS = 600  # the first conversations of chitchat.jsonl (--example_records)

# The ways of preparing one conversation: (name, PreparationSpec arguments).
VARIANTS = [("whole", dict(max_len=100_000, long_conversations="truncate")),
            ("split", dict(max_len=MAX_LEN, long_conversations="split")),
            ("truncate", dict(max_len=MAX_LEN, long_conversations="truncate")),
            ("refuse", dict(max_len=MAX_LEN, long_conversations="refuse")),
            ("mask_history", dict(max_len=100_000, long_conversations="split", last_reply_only=True)),
            ("allow_dropped", dict(max_len=100_000, long_conversations="split", allow_dropped_content=True)),
            ("system_split", dict(max_len=MAX_LEN + 24, long_conversations="split",
                                  system_message="You answer in one short sentence."))]

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
LONG = " ".join(f"word{i}" for i in range(60))
# Every form of record the data tests know, valid and not.
RECORDS = {
    "qwen_conversations": {"id": "q1", "conversations": [{"from": "user", "value": "Hi there"},
                                                         {"from": "assistant", "value": "Hello! How can I help?"}]},
    "human_gpt_aliases": {"id": "q2", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
        {"from": "human", "value": "3+3?"}, {"from": "gpt", "value": "6"}]},
    "messages": {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]},
    "alpaca": {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
    "alpaca_no_input": {"id": 7, "instruction": "Say hi.", "output": "Hi."},
    "reasoning_field": {"messages": [{"role": "user", "content": "What is 12 times 3?"},
                                     {"role": "assistant", "reasoning_content": "10*3=30, 2*3=6.", "content": "36."},
                                     {"role": "user", "content": "Halve it."},
                                     {"role": "assistant", "reasoning_content": "36/2=18.", "content": "18."}]},
    "reasoning_think_tag": {"messages": [{"role": "user", "content": "Is 7 prime?"},
                                         {"role": "assistant", "content": "<think>Divisors: 1 and 7.</think>Yes."}]},
    "tool_round_trip": {"tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
        "messages": [{"role": "user", "content": "Rain in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"rain": true}'},
                     {"role": "assistant", "content": "Yes, it rains."}]},
    "tool_call_dict_arguments": {"messages": [
        {"role": "user", "content": "Rain in Oslo?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                               "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "no rain"}, {"role": "assistant", "content": "No rain in Oslo."}]},
    "train_false": {"messages": [{"role": "user", "content": "A?"},
                                 {"role": "assistant", "content": "B.", "train": False},
                                 {"role": "user", "content": "C?"}, {"role": "assistant", "content": "D."}]},
    "weight_zero_last": {"messages": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "B."},
                                      {"role": "user", "content": "C?"},
                                      {"role": "assistant", "content": "D.", "weight": 0}]},
    "long_turns": {"messages": [{"role": "user", "content": "Tell me. " + LONG},
                                {"role": "assistant", "content": "Sure. " + LONG},
                                {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Done."}]},
    "long_reply": {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": LONG * 2}]},
    "unicode": {"messages": [{"role": "user", "content": "Übersetze: 猫"},
                             {"role": "assistant", "content": "Katze 🐈"}]},
    "bad_not_object": [1, 2],
    "bad_missing_key": {"id": "m", "talk": []},
    "bad_both_forms": {"conversations": [], "messages": []},
    "bad_empty": {"messages": []},
    "bad_role": {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
    "bad_no_reply": {"messages": [{"role": "user", "content": "Only a question"}]},
    "bad_content_type": {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
    "bad_surrogate": {"messages": [{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "y"}]},
    "bad_tool_result_unknown": {"messages": [{"role": "user", "content": "Q"},
                                             {"role": "tool", "tool_call_id": "zz", "content": "r"},
                                             {"role": "assistant", "content": "A"}]},
}
FORM_TEMPLATES = ["Qwen-Qwen3-0.6B", "meta-llama-Llama-3.3-70B-Instruct", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
                  "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "google-gemma-2-2b-it",
                  "mistralai-Mistral-Nemo-Instruct-2407"]


def wing(name: str):
    """The module ``sft.data.<name>`` (``"encode.samples"``), or, in a tree from before the wing's stages had folders
    of their own, ``sft.data.<its last part>`` (``sft.data.samples``)."""
    import importlib

    try:
        return importlib.import_module(f"sft.data.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"sft.data.{name.rsplit('.', 1)[-1]}")


def jsonable(x):
    if hasattr(x, "tolist"):  # a tensor of a lazy dataset's item
        x = x.tolist()
    return x if isinstance(x, (str, int, float, bool, type(None))) else (
        [jsonable(v) for v in x] if isinstance(x, (list, tuple)) else
        {str(k): jsonable(v) for k, v in sorted(x.items())} if isinstance(x, dict) else repr(x))


def refusal(e: Exception, conv=None) -> dict:
    template_problem = wing("records.records").template_problem

    # the class as the user meets it: the first of sft.errors' (its exit code) or Python's
    kind = next(c for c in type(e).__mro__ if c.__module__ in ("sft.errors", "builtins"))
    out = {"error": kind.__name__, "text": str(e),
           **{a: jsonable(getattr(e, a)) for a in ("turn", "what", "fix") if hasattr(e, a)}}
    if conv is not None:  # the record problem it becomes (its text, turn and kind)
        problem = template_problem("case", conv, e)
        out["problem"], out["problem_fields"] = str(problem), jsonable(problem.__dict__)
    return out


def prepared(tok, conv, eot: int, spec) -> dict:
    """One conversation's samples (or refusal) and the truncation report under ``spec``."""
    encode_samples = wing("encode.samples").encode_samples
    try:
        TruncationReport = wing("encode.report").TruncationReport
    except ImportError:  # before the report had a module of its own (bd8f322)
        TruncationReport = wing("encode.samples").TruncationReport

    try:
        got = encode_samples(tok, [conv.messages], eot, spec, [conv.tools])[0]
    except Exception as e:  # noqa: BLE001  (a crash is an outcome to compare too)
        return {"crash": refusal(e)}
    if isinstance(got, Exception):
        return {"refused": refusal(got, conv)}
    report = TruncationReport(mode=spec.long_conversations)
    report.count_conversation(got, conv.id, conv.index)
    return {**conversation_samples(got), "report": jsonable(report.__dict__),
            "report_lines": report.lines("case", spec.max_len)}


CONVERSATION_KEYS = ("dropped", "extra_samples", "extra_tokens")


def conversation_samples(got) -> dict:
    """A conversation's samples in one form on either side: ``samples`` (each sample's fields) and ``conversation``
    (what the whole conversation cost, 0 where not said): a ``ConversationSamples``' fields, or, before it existed,
    the keys its first sample dict carried."""
    if hasattr(got, "samples"):
        samples, conv = [dict(ex) for ex in got.samples], {k: getattr(got, k) for k in CONVERSATION_KEYS}
    else:
        samples = [dict(ex) for ex in got]
        conv = {k: samples[0].pop(k, 0) for k in CONVERSATION_KEYS}
    return {"samples": jsonable(samples), "conversation": conv}


def end_of_turn(tok, model_end=()):
    from sft.errors import SFTError

    end_of_turn_id = wing("template.end_tokens").end_of_turn_id

    try:
        return end_of_turn_id(tok, tok.convert_tokens_to_ids(list(model_end))), None
    except SFTError as e:
        return None, {"eot_refused": refusal(e)}


def corpus_cases(write) -> None:
    from sft.data.spec import PreparationSpec
    from tests.helpers import template_corpus as tc

    normalize_record, with_template_kwargs = wing("records.records").normalize_record, wing(
        "template.chat_template").with_template_kwargs
    found = tc.templates()
    tok = tc.shared_tokenizer(found)
    for name, text in found.items():
        for kind, record in tc.KINDS.items():
            kwargs = tc.KWARGS.get((name, kind))
            tc.use(tok, with_template_kwargs(text, kwargs) if kwargs else text)
            conv = normalize_record("corpus", 0, record)
            eot, refused = end_of_turn(tok, tc.MODEL_END.get(name, ()))
            for variant, args in VARIANTS:
                out = refused or prepared(tok, conv, eot, PreparationSpec(**args))
                write(f"corpus/{name}/{kind.replace(' ', '_')}/{variant}", out)


def form_cases(write) -> None:
    from sft.data.spec import PreparationSpec
    from tests.helpers import assets, template_corpus as tc

    records = wing("records.records")
    Conversation, normalize_record = records.Conversation, records.normalize_record
    ensure_chat_template = wing("template.chat").ensure_chat_template
    found = tc.templates()
    tok = tc.shared_tokenizer(found)
    from transformers import AutoTokenizer

    chatml = AutoTokenizer.from_pretrained(assets.qwen_tokenizer_dir())
    ensure_chat_template(chatml)
    toks = [("chatml_fallback", chatml, ())]
    toks += [(t, tok, tc.MODEL_END.get(t, ())) for t in FORM_TEMPLATES if t in found]
    for rname, rec in RECORDS.items():
        conv = normalize_record("forms.jsonl", 3, rec)
        if not isinstance(conv, Conversation):
            write(f"forms/{rname}/record", {"problems": [str(p) for p in conv],
                                            "fields": [jsonable(p.__dict__) for p in conv]})
            continue
        write(f"forms/{rname}/record", {"conversation": jsonable(conv.__dict__)})
        for tname, t, model_end in toks:
            if t is tok:
                tc.use(tok, found[tname])
            eot, refused = end_of_turn(t, model_end)
            for variant, args in VARIANTS:
                write(f"forms/{rname}/{tname}/{variant}", refused or prepared(t, conv, eot, PreparationSpec(**args)))


def example_cases(write, n_records: int) -> None:
    from sft.app.data import load_records
    from sft.data.spec import PreparationSpec
    from sft.model.loading import load_tokenizer

    folder = os.path.join(ROOT, ".cache", "example")
    data, model = os.path.join(folder, "chitchat.jsonl"), os.path.join(folder, "smollm2-135m-instruct")
    if not (os.path.isfile(data) and os.path.isdir(model)):
        sys.exit(f"error: {folder} lacks chitchat.jsonl or smollm2-135m-instruct/; run: "
                 ".venv/bin/python scripts/prepare_example.py")
    tok, eot, _grew = load_tokenizer(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chitchat.jsonl")
        with open(data, encoding="utf-8") as src, open(path, "w", encoding="utf-8") as dst:
            for _ in range(n_records):
                line = src.readline()
                if not line:
                    break
                dst.write(line)
        for mode in ("split", "truncate", "refuse", "lazy"):
            spec = PreparationSpec(max_len=EXAMPLE_MAX_LEN, long_conversations="truncate" if mode == "lazy" else mode,
                                   lazy=mode == "lazy", on_bad_record="skip", cache_dir=os.path.join(tmp, mode))
            try:
                ds, report = load_records({"train": [path]}, tok, eot, spec)["train"]
            except Exception as e:  # noqa: BLE001
                write(f"example/{mode}/refused", refusal(e))
                continue
            rows = [ds[i] for i in range(len(ds))]
            for start in range(0, len(rows), 100):  # one case per 100 samples: a difference is found quickly
                write(f"example/{mode}/rows_{start:05d}", jsonable(rows[start:start + 100]))
            if report is not None:
                write(f"example/{mode}/report", {"report": jsonable(report.__dict__),
                                                 "lines": report.lines("train", EXAMPLE_MAX_LEN)})


def dump(out: str, n_records: int) -> None:
    import logging

    import sft

    logging.disable(logging.WARNING)  # the preparation's own notes (skipped records, ...) are in the cases

    tree = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or ROOT
    here = os.path.dirname(os.path.dirname(os.path.abspath(sft.__file__)))
    if os.path.realpath(here) != os.path.realpath(tree):
        sys.exit(f"error: sft was imported from {here}, not from {tree} (the first entry of PYTHONPATH)")
    os.makedirs(out, exist_ok=True)
    manifest = {}

    def write(case: str, value) -> None:
        data = json.dumps(value, sort_keys=True, ensure_ascii=False, indent=0).encode()
        manifest[case] = hashlib.sha256(data).hexdigest()
        path = os.path.join(out, case.replace("/", os.sep) + ".json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    corpus_cases(write)
    form_cases(write)
    example_cases(write, n_records)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"tree": here, "cases": manifest}, f, indent=1, sort_keys=True)
    print(f"{len(manifest)} cases from {here} -> {out}")


def compare(a: str, b: str) -> int:
    cases = [json.load(open(os.path.join(d, "manifest.json")))["cases"] for d in (a, b)]
    names = sorted(set(cases[0]) | set(cases[1]))
    missing = [n for n in names if n not in cases[0] or n not in cases[1]]
    differ = [n for n in names if n not in missing and cases[0][n] != cases[1][n]]
    same = len(names) - len(missing) - len(differ)
    by_group: dict = {}
    for n in names:
        g = by_group.setdefault(n.split("/")[0], [0, 0])
        g[0] += 1
        g[1] += n not in missing and n not in differ
    for g, (total, ok) in sorted(by_group.items()):
        print(f"{g}: {ok} of {total} cases identical")
    for n in missing:
        print(f"missing on one side: {n}")
    for n in differ[:20]:
        print(f"differs: {n}")
    if len(differ) > 20:
        print(f"... and {len(differ) - 20} more")
    print(f"{same} of {len(names)} cases identical ({len(differ)} differ, {len(missing)} missing)")
    return 0 if same == len(names) else 1


def run_tree(tree: str, out: str, n_records: int) -> None:
    env = dict(os.environ, PYTHONPATH=tree, SFT_TEST_ASSETS=os.environ.get(
        "SFT_TEST_ASSETS", os.path.join(ROOT, ".cache", "test-assets")))
    subprocess.run([sys.executable, os.path.abspath(__file__), "--dump", out, "--example_records", str(n_records)],
                   cwd=tree, env=env, check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--base", help="a commit: its samples against this tree's")
    g.add_argument("--dump", metavar="DIR", help="write this tree's cases into DIR")
    g.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"), help="compare two dump folders")
    p.add_argument("--head", help="with --base: a commit to compare with it (default: this working tree, as it is)")
    p.add_argument("--out", help="with --base: keep the two dumps here (default: a temporary folder)")
    p.add_argument("--example_records", type=int, default=EXAMPLE_RECORDS, help="chitchat conversations used")
    args = p.parse_args()
    if args.dump:
        dump(args.dump, args.example_records)
        return 0
    if args.compare:
        return compare(*args.compare)
    out = args.out or tempfile.mkdtemp(prefix="compare-samples-")
    trees = []
    try:
        for commit in [args.base] + ([args.head] if args.head else []):
            trees.append(tempfile.mkdtemp(prefix="compare-tree-"))
            os.rmdir(trees[-1])
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", trees[-1], commit], check=True)
        run_tree(trees[0], os.path.join(out, "base"), args.example_records)
        run_tree(trees[1] if args.head else ROOT, os.path.join(out, "head"), args.example_records)
    finally:
        for tree in trees:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=True)
    print(f"base {args.base} vs {args.head or ROOT} (dumps in {out}):")
    return compare(os.path.join(out, "base"), os.path.join(out, "head"))


if __name__ == "__main__":
    sys.exit(main())
