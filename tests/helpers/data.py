"""Toy conversations and a JSONL writer, shared by the tests (the ``toy_data`` fixture writes TOY)."""
import json


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


TOY = [
    {"id": "add", "conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "2+2 is 4."}]},
    {"id": "color", "conversations": [
        {"from": "system", "value": "You are terse."}, {"from": "user", "value": "Name a color."},
        {"from": "assistant", "value": "Blue."}, {"from": "user", "value": "Another one?"},
        {"from": "assistant", "value": "Red."}]},
    {"id": "hi", "messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"}]},
    {"id": "count", "messages": [{"role": "user", "content": "Count to three"},
                                 {"role": "assistant", "content": "One, two, three."}]},
    {"id": "cap", "messages": [{"role": "user", "content": "Capital of France?"},
                               {"role": "assistant", "content": "Paris is the capital of France."}]},
    {"id": "sky", "messages": [{"role": "user", "content": "Why is the sky blue?"},
                               {"role": "assistant", "content": "Rayleigh scattering of sunlight."}]},
    {"id": "dog", "messages": [{"role": "user", "content": "What sound does a dog make?"},
                               {"role": "assistant", "content": "Woof."}]},
    {"id": "sum", "messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]},
]
