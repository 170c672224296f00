"""The uses of transformers' (and argparse's) private names outside the Trainer (checked against transformers 5.24).

Each function is one use, named for what it gives; on another version the private name may be gone or changed, and
the function is the one place to look.
"""
from __future__ import annotations

from typing import Optional

CHECKED_TRANSFORMERS_VERSION = "5.24"


def compile_jinja_template(template: str):
    """transformers' compiled jinja template for a chat template string, as ``apply_chat_template`` compiles it
    (``transformers.utils.chat_template_utils._compile_jinja_template``, cached there by template text)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template)


def plain_template_data(special_tokens: dict) -> dict:
    """The template variables ``apply_chat_template`` passes for the tokenizer's special tokens
    (``transformers.utils.chat_template_utils._plain_template_data``: added-token objects become their strings)."""
    from transformers.utils.chat_template_utils import _plain_template_data

    return _plain_template_data(special_tokens)


def attn_implementation(config) -> Optional[str]:
    """The attention implementation a model config runs with (``config._attn_implementation``: "sdpa", "eager",
    "flash_attention_2", a registered name), or None when unset."""
    return getattr(config, "_attn_implementation", None)


def parser_actions(parser) -> list:
    """An ``argparse.ArgumentParser``'s actions (``parser._actions``; argparse has no public list of them). Used to
    read a flag's ``dest`` / ``nargs`` and to set one flag's ``type`` after ``HfArgumentParser`` built it."""
    return parser._actions


def grouped_linear(x, weight, offsets, bias=None, is_transposed: bool = False):
    """The frozen experts' grouped projection as transformers' ``grouped_mm`` experts path computes it
    (``transformers.integrations.moe._grouped_linear``: ``x`` [S, in] sorted by expert, ``weight`` [E, out, in] or
    [E, in, out] with ``is_transposed``, ``offsets`` [E] int32 cumulative row counts, ``bias`` [S, out] or None;
    returns [S, out] in the weight's dtype; torch's ``grouped_mm`` where it applies, transformers' loop otherwise)."""
    from transformers.integrations.moe import _grouped_linear

    return _grouped_linear(x, weight, offsets, bias=bias, is_transposed=is_transposed)


def experts_apply_gate(experts, h):
    """The gated activation of an experts module of transformers' ``use_experts_implementation`` layout over the
    fused gate/up product ``h`` [tokens, 2·intermediate] -> [tokens, intermediate]: its private ``_apply_gate``
    (transformers 5.24; gpt-oss's clamped, interleaved form included)."""
    return experts._apply_gate(h)


def experts_are_parallel(experts) -> bool:
    """True when transformers spread this experts module across ranks (``DistributedConfig(ep_size)``): its private
    ``_is_expert_parallel`` flag (transformers 5.24); False where the attribute is missing."""
    return bool(getattr(experts, "_is_expert_parallel", False))
