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


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# Conversations as reasoning models and agents write them (issue 32), one per accepted form.
AGENT = [
    {"id": "think-inline", "messages": [
        {"role": "user", "content": "What is 12 times 3?"},
        {"role": "assistant", "content": "<think>\nTen threes are 30, two more are 6.\n</think>\n\n36."},
        {"role": "user", "content": "Halve it."},
        {"role": "assistant", "content": "<think>\n36 / 2 = 18.\n</think>\n\n18."}]},
    {"id": "reasoning-field", "messages": [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "reasoning_content": "91 = 7 x 13.", "content": "No, 91 = 7 x 13."}]},
    {"id": "openai-tools", "tools": [WEATHER_TOOL], "messages": [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": "Is it raining in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"rain\": true, \"temp\": 11}"},
        {"role": "assistant", "content": "Yes, it is raining in Paris (11 degrees)."}]},
    {"id": "content-parts", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Translate to French:"},
                                     {"type": "text", "text": "cat"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "chat"}]}]},
    {"id": "llama-factory-tools", "tools": json.dumps([WEATHER_TOOL["function"]]), "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": "{\"rain\": false, \"temp\": -3}"},
        {"from": "gpt", "value": "Dry and cold: -3 degrees."}]},
    {"id": "train-false", "messages": [
        {"role": "user", "content": "Say something rude."},
        {"role": "assistant", "content": "You are a potato.", "train": False},
        {"role": "user", "content": "Say something kind."},
        {"role": "assistant", "content": "You are doing great."}]},
]
