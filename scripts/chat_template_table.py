#!/usr/bin/env python
"""Print the table of docs/data-format.md "Real chat templates": how each of the 70 templates of llama.cpp's collection
(PyPI's llama-cpp-python==0.3.36 source distribution, downloaded once into .cache/test-assets) handles a multi-turn
conversation with a system prompt, multi-turn reasoning and a tool round trip: trained with labels equal to the
definition (checked), or refused with the template's reason. tests/integration/data/test_template_corpus.py checks
that the docs hold this table.

    .venv/bin/python scripts/chat_template_table.py
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    from tests.helpers.template_corpus import markdown_table, outcomes

    table = outcomes()
    print(markdown_table(table))
    kinds = len(next(iter(table.values())))
    trained = [sum(row[k].startswith("trains") for row in table.values()) for k in range(kinds)]
    print(f"\n{len(table)} templates; trained per kind: {trained}", file=sys.stderr)
    return 0


def with_repository_on_pythonpath() -> None:
    """tests.helpers (the corpus and its tokenizer) is imported from the repository: started without it on
    PYTHONPATH, run again with it (as scripts/kill_resume_loop.py does)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in map(os.path.abspath, paths):
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])


if __name__ == "__main__":
    with_repository_on_pythonpath()
    sys.exit(main())
