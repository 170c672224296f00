"""Every rank compares its inputs before the model loads: data files, model config, tokenizer, version.

After the process group is up, :func:`check_same_inputs` gathers each rank's :func:`input_fingerprint`
(sha256 of the file bytes; contents are compared, not paths) and fails on every rank together when any item
differs, naming the node ranks and hosts on each side (no more ``md5sum`` on every node by hand).
"""
from __future__ import annotations

import hashlib
import os
import re
import socket
from typing import Optional

from sft import __version__
from sft.distributed.collectives import gather_objects, world_size
from sft.distributed.contract import route_source
from sft.errors import PreflightError
from sft.fsio import file_sha256

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "qwen.tiktoken", "chat_template.jinja",
                   "chat_template.json")


def _model_file(model: str, name: str) -> Optional[str]:
    if os.path.isdir(model):
        path = os.path.join(model, name)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, name)
        return found if isinstance(found, str) else None
    except ImportError:
        return None


def input_fingerprint(model_path: str, data_files: dict[str, str]) -> dict:
    """What must be identical on every rank: ``{"<flag> file": sha256, "model config (config.json)": sha256,
    "tokenizer files": sha256, "sft version": str, "world view": str}`` (hex digests of file bytes).

    ``data_files`` maps a flag (``--data_path``) to the file it names on this node; the contents are compared,
    not the paths."""

    fp = {f"{flag} file": file_sha256(path) for flag, path in data_files.items()}
    cfg = _model_file(model_path, "config.json")
    fp["model config (config.json)"] = file_sha256(cfg) if cfg else "missing"
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = _model_file(model_path, name)
        if path:
            h.update(name.encode() + b"\0" + file_sha256(path).encode())
    fp["tokenizer files"] = h.hexdigest()
    fp["sft version"] = __version__
    fp["world view"] = (f"world size {os.environ.get('WORLD_SIZE')}, {os.environ.get('GROUP_WORLD_SIZE', '?')} nodes, "
                        f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} per node")
    return fp


def _rank_info() -> dict:
    # torchrun sets GROUP_RANK, Ray Train NODE_RANK
    node_rank = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    return {"rank": int(os.environ.get("RANK", "0")), "node_rank": int(node_rank),
            "host": socket.gethostname(),
            "addr": route_source(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "1")))}


def compare_fingerprints(infos: list[dict]) -> list[str]:
    """One line per fingerprint item on which ranks disagree, naming the node ranks/hosts on each side.

    ``infos``: one ``{"rank", "node_rank", "host", "fp": {item: value}}`` per rank, in rank order, optionally
    with ``"where": {item: text}`` shown next to a value (the file's path on that node). The value of global
    rank 0 is the reference.
    """
    problems = []
    for item in infos[0]["fp"]:
        groups: dict[str, list[dict]] = {}
        for info in infos:
            groups.setdefault(str(info["fp"].get(item, "missing")), []).append(info)
        if len(groups) == 1:
            continue
        ref = str(infos[0]["fp"].get(item, "missing"))
        sides = []
        for value, members in sorted(groups.items(), key=lambda kv: kv[0] != ref):
            nodes = sorted({(m["node_rank"], m["host"]) for m in members})
            who = ", ".join(f"node rank {n} ({h})" for n, h in nodes)
            shown = value[:12] + "..." if re.fullmatch(r"[0-9a-f]{64}", value) else value
            where = sorted({m.get("where", {}).get(item) for m in members} - {None})
            shown += f" ({', '.join(where)})" if where else ""
            sides.append(f"{who}: {shown}")
        problems.append(f"{item} differs between nodes: " + "; ".join(sides))
    for info in infos:
        for item in info["fp"]:
            if item not in infos[0]["fp"]:
                problems.append(f"{item}: only on node rank {info['node_rank']} ({info['host']})")
    return problems


def check_same_inputs(model_path: str, data_files: dict[str, Optional[str]], extra: Optional[dict] = None
                      ) -> dict[str, dict]:
    """All ranks: gather every rank's :func:`input_fingerprint`, with the caller's ``extra`` items (name: value,
    e.g. the data preparation code's fingerprint), and fail together when any item differs.

    Needs an initialised default process group; a no-op for one process.

    Returns:
        The job's peers by address, ``{addr: {"node_rank", "host", "ranks": [global ranks]}}`` (empty for one
        process), which :func:`sft.distributed.failures.explain_collective_failure` uses to name a lost peer.

    Raises:
        PreflightError: naming each differing item and the node ranks / hosts holding each version.
    """
    if world_size() == 1:
        return {}
    files = {flag: path for flag, path in data_files.items() if path}
    mine = {**_rank_info(), "fp": {**input_fingerprint(model_path, files), **(extra or {})},
            "where": {f"{f} file": p for f, p in files.items()}}
    infos = gather_objects(mine)
    peers: dict[str, dict] = {}
    for info in infos:
        peer = peers.setdefault(info["addr"] or "?",
                                {"node_rank": info["node_rank"], "host": info["host"], "ranks": []})
        peer["ranks"].append(info["rank"])
    problems = compare_fingerprints(infos)
    if problems:
        raise PreflightError("the nodes do not train on the same inputs:\n" + "\n".join(f"  - {p}" for p in problems)
                             + "\nCopy the same files to every node (or keep them on a shared filesystem), then start "
                             "again; SFT_PREFLIGHT=0 skips this check")
    return peers
