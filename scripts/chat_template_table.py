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
sys.path.insert(0, ROOT)

from tests.helpers.template_corpus import markdown_table, outcomes  # noqa: E402

if __name__ == "__main__":
    table = outcomes()
    print(markdown_table(table))
    kinds = len(next(iter(table.values())))
    trained = [sum(row[k].startswith("trains") for row in table.values()) for k in range(kinds)]
    print(f"\n{len(table)} templates; trained per kind: {trained}", file=sys.stderr)
