"""Questions about a tokenizer's vocabulary answered from its fast backend (``tokenizers.Tokenizer``), without
``get_vocab()``: that builds the whole token -> id dict, 0.1 s of CPU each time for Qwen's 151,646 tokens, paid by
every process that loads a tokenizer (each training rank, the launcher's ``sft check``)."""
from __future__ import annotations


def has_token(tokenizer, token: str) -> bool:
    """Whether the string ``token`` is in ``tokenizer``'s vocabulary, added tokens included (the backend's
    ``token_to_id``; ``get_vocab()`` for a tokenizer without a fast backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.token_to_id(token) is not None
    return token in tokenizer.get_vocab()


def special_only_size(tokenizer) -> int | None:
    """The vocabulary's size when it is empty or every id in it is a special id (``all_special_ids``: what transformers
    5 builds from a folder without tokenizer files); None when it holds more. Answered from the backend when one of the
    first ``len(special) + 64`` ids is not special and names a token (``id_to_token``); the whole vocabulary is read
    only without a fast backend, or for a vocabulary that small or sparse (where the answer may be a size)."""
    special, backend = set(tokenizer.all_special_ids), getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and any(i not in special and backend.id_to_token(i) is not None
                                   for i in range(len(special) + 64)):
        return None
    vocab = tokenizer.get_vocab()
    return len(vocab) if not vocab or set(vocab.values()) <= special else None
