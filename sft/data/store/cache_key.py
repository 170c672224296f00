"""The name of a source's prepared-data cache folder (:mod:`sft.data.store.dataset`): what decides its samples,
hashed."""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os

from sft import __version__
from sft.compat import jinja
from sft.fsio import file_sha256

CACHE_FORMAT = 5  # bump when the cached columns or their meaning change (4: the ``record`` column; 5: labels by the
# definition of sft.data.encode.turns, the lazy records as JSON)
RENDERING_ADAPTERS = (jinja,)  # modules outside sft/data that decide the rendered text (the compiled chat template)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the token ids: backend vocabulary/merges, added tokens, chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)).encode())
    h.update(json.dumps(tokenizer.get_added_vocab(), sort_keys=True).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def preparation_code_fingerprint(folder: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) -> str:
    """sha256 of the source of every module of ``sft.data`` (``folder`` and its sub-folders, by path relative to it)
    and of the adapters it renders through (:data:`RENDERING_ADAPTERS`): what turns records into samples and the
    report. A cache written by other preparation code is never read, whether or not someone bumped
    :data:`CACHE_FORMAT` (a report cached before a field existed printed "(the first 0)")."""
    h = hashlib.sha256()
    files = []
    for at, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files += [os.path.join(at, n) for n in sorted(names) if n.endswith(".py")]
    for path in files + [inspect.getsourcefile(m) for m in RENDERING_ADAPTERS]:
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, folder).encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def cache_key(data_path: str, tokenizer, settings: dict) -> str:
    """24 hex digits naming a source's cache folder: its bytes, the tokenizer, ``settings``, the version and the
    preparation code (:func:`preparation_code_fingerprint`)."""
    h = hashlib.sha256()
    for part in (file_sha256(data_path), tokenizer_fingerprint(tokenizer), json.dumps(settings, sort_keys=True),
                 __version__, str(CACHE_FORMAT), preparation_code_fingerprint()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]
