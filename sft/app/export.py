"""``sft-export CHECKPOINT OUT``: any checkpoint sft writes -> a transformers model folder, verified.

What a ``checkpoint-N`` folder holds decides how its weights are read (:func:`checkpoint_kind`):

* ``lora``: a peft adapter (``adapter_config.json``): copied as it is (adapter, tokenizer, generation config), or with
  ``merge`` merged into its base (:func:`sft.model.export.merge_adapter`);
* ``zero``: DeepSpeed ZeRO-2/3 shards (``latest`` + ``global_stepN/*zero_pp_rank_R_*``): the fp32 master weights,
  consolidated by DeepSpeed's own ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (exact
  also where the checkpoint's gathered ``model.safetensors`` is a 16-bit copy, or missing);
* ``dcp``: torch.distributed.checkpoint shards (a folder with ``.metadata`` and ``__R_K.distcp``, as FSDP2 writes with
  ``SHARDED_STATE_DICT``: accelerate's ``pytorch_model_fsdp_0/`` holding ``{"model": state dict}``), read into a model
  built from the checkpoint's config (DCP reshards on load, so any world size reads them in one process);
* ``full``: a consolidated model (``model*.safetensors``: DDP, and FSDP2 with ``FULL_STATE_DICT``).

Before anything is read the checkpoint must pass :func:`sft.train.checkpoint.verify` (completion marker, sizes,
checksums): an incomplete or damaged checkpoint is refused, naming the file. After writing, the folder is reloaded
with ``AutoModelForCausalLM.from_pretrained`` and its logits on a few tokens compared with those of the checkpoint's
weights (:data:`EXACT_ATOL`, :data:`MERGE_ATOL`).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from typing import Optional

from sft.compat.peft import without_gptqmodel, without_v4_moe_conversion
from sft.errors import SFTError, explain_load_errors
from sft.model.architecture import auto_class, auto_class_of
from sft.model.export import merge_adapter
from sft.model.folders import MODEL_FILES, check_out_dir, write_folder
from sft.model.vllm_adapter import SERVERS, write_vllm_adapter
from sft.train.checkpoint import checkpoint_dirs, latest_complete, verify, zero_world_size
from sft.train.integrity import HASH, MARKER, file_digest

KINDS = {"lora": "a LoRA adapter", "zero": "DeepSpeed ZeRO shards", "dcp": "torch.distributed.checkpoint shards",
         "full": "a full model"}
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Logits of the written folder against the checkpoint's weights (both computed in float32 on the same tokens):
# the folder holds exactly the weights (cast to the chosen dtype, the reference is cast the same way), so only float
# noise may differ (measured: 0.0 on the tiny model); a wrong, missing or reordered tensor moves logits by far more.
EXACT_ATOL = 1e-5
# A merged adapter (W + B A in one matrix) against base + adapter applied separately: the same sums in another order
# (tests/integration/distributed/test_deepspeed.py's merge test uses the same bound).
MERGE_ATOL = 1e-4
PROBE = "Hello! What is 2 + 3? Answer in one short sentence."
PROBE_TOKENS = 32  # at most this many tokens are compared


@dataclass(frozen=True)
class Exported:
    """What :func:`export_checkpoint` wrote: ``out_dir`` (real path), ``kind`` (a key of :data:`KINDS`), ``source``
    (the files the weights were read from, for the message), ``files`` (the folder's file names), ``tokens`` (tokens
    whose logits were compared; 0 for a copied adapter, whose files are compared by checksum instead),
    ``max_abs_diff`` and ``tolerance`` (absolute, on logits)."""
    out_dir: str
    kind: str
    source: str
    files: tuple[str, ...]
    tokens: int
    max_abs_diff: float
    tolerance: float


class ExportMismatch(SFTError):
    """The written folder does not reload to the checkpoint's logits: a bug or a library change, not a user error."""

    exit_code = 1


def checkpoint_kind(path: str) -> str:
    """The key of :data:`KINDS` for checkpoint folder ``path`` (see the module docstring; an adapter first: a LoRA run
    under DeepSpeed also holds ZeRO shards, of the adapter only).

    Raises:
        SFTError: no weights sft knows how to read.
    """
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        if not any(n.startswith("adapter_model.") for n in os.listdir(path)) and dcp_folder(path) is not None:
            raise SFTError(f"{path}: a LoRA adapter in FSDP2 shards (torch.distributed.checkpoint) is not exported by "
                           "sft-export yet; export the run's final adapter in its --output_dir (adapter_model."
                           "safetensors, gathered at the end of training), or train with \"state_dict_type\": "
                           "\"FULL_STATE_DICT\" in --fsdp_config to get adapter files in every checkpoint")
        return "lora"
    if zero_world_size(path) is not None:
        return "zero"
    if dcp_folder(path) is not None:
        return "dcp"
    if any(n.startswith(("model.safetensors", "model-0", "pytorch_model.bin")) for n in os.listdir(path)):
        return "full"
    raise SFTError(f"{path}: holds no weights sft can export (no adapter_config.json, no DeepSpeed global_step*/ "
                   "shards, no torch.distributed.checkpoint .metadata, no model*.safetensors); give a checkpoint-N "
                   "folder written by sft-train")


def dcp_folder(path: str) -> Optional[str]:
    """The torch.distributed.checkpoint folder of the model in checkpoint ``path`` (``path`` itself, else its
    ``pytorch_model_fsdp_0``, else another subfolder with a ``.metadata`` that is not an optimizer's), or None."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    subs = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n, ".metadata"))
                  and not n.startswith("optimizer"))
    subs.sort(key=lambda n: n != "pytorch_model_fsdp_0")
    return os.path.join(path, subs[0]) if subs else None


def check_checkpoint(path: str) -> None:
    """Refuse a folder that is not a complete, intact checkpoint (:func:`sft.train.checkpoint.verify`: marker, sizes,
    XXH3-128 checksums of every file).

    Raises:
        SFTError: naming ``path``, the reason (the bad file) and the fix.
    """
    if not os.path.isdir(path):
        raise SFTError(f"{path}: no such folder; give a checkpoint-N folder written by sft-train")
    if not os.path.exists(os.path.join(path, MARKER)) and checkpoint_dirs(path):
        newest = latest_complete(path)
        hint = f"e.g. its newest complete one, {newest}" if newest else "none of them is complete"
        raise SFTError(f"{path}: is an --output_dir holding checkpoints, not a checkpoint; give one of them ({hint})")
    why = verify(path)
    if why is not None:
        raise SFTError(f"{path}: not a complete, intact checkpoint: {why}; it cannot be exported (an interrupted save "
                       "or files changed on disk); export another checkpoint, e.g. the newest complete one of its "
                       "--output_dir")


def export_checkpoint(checkpoint: str, out_dir: str, merge: bool = False, base: Optional[str] = None,
                      overwrite: bool = False, dtype: str = "auto", max_shard_size: str = "5GB",
                      server: Optional[str] = None) -> Exported:
    """Write checkpoint folder ``checkpoint`` as a model folder ``out_dir`` (sharded safetensors of at most
    ``max_shard_size`` each, config, tokenizer with its chat template, generation config) and verify it.

    Args:
        merge: a LoRA checkpoint: merge the adapter into its base (``base``, default the one recorded in
            adapter_config.json); without it the adapter folder is copied.
        overwrite: allow a non-empty ``out_dir`` that holds only model-folder files
            (:data:`sft.model.folders.MODEL_FILES`).
        server: ``vllm``: a LoRA adapter is written with its routed experts in vLLM's 3-D expert layout
            (:mod:`sft.model.vllm_adapter`; ``base`` then names the base model whose config gives their shapes);
            None: copied as it is.
        dtype: the weights' dtype in ``out_dir``, one of :data:`DTYPES`; ``auto``: the checkpoint config's ``dtype``
            (float32 when it names none). Not used for an adapter (copied or merged in float32).

    Raises:
        SFTError: an incomplete or damaged checkpoint, an unknown layout, ``merge``/``base`` given for a checkpoint
            that holds no adapter, ``server`` given for anything but a LoRA adapter copied, a server other than
            those of :data:`sft.model.vllm_adapter.SERVERS` or an adapter that server would misread
            (:func:`sft.model.vllm_adapter.vllm_expert_keys`), ``out_dir`` refused
            (:func:`sft.model.folders.check_out_dir`), weights that do not fit the checkpoint's config;
            :class:`ExportMismatch` when the reloaded folder's logits differ.
    """
    if dtype not in DTYPES:
        raise SFTError(f"--dtype {dtype}: give one of {', '.join(DTYPES)}")
    if not re.fullmatch(r"[1-9]\d*[KMG]i?B", str(max_shard_size)):  # what save_pretrained takes (transformers 5.24)
        raise SFTError(f"--max_shard_size {max_shard_size}: give a size such as 5GB, 500MB or 2GiB")
    if server is not None and server not in SERVERS:
        raise SFTError(f"--for {server}: not a server sft-export writes for (only {', '.join(SERVERS)}); its reading "
                       "of 3-D expert LoRA was not established, and an adapter it silently dropped would serve the "
                       "base model; serve the merged model instead (sft-export --merge, which every server reads)")
    check_checkpoint(checkpoint)
    kind = checkpoint_kind(checkpoint)
    if server is not None and (kind != "lora" or merge):
        raise SFTError(f"--for {server}: lays out a LoRA adapter for that server; "
                       + (f"{checkpoint} holds {KINDS[kind]}" if kind != "lora" else "with --merge the model is "
                          "merged, which the server reads as it is") + "; drop --for")
    if kind != "lora" and (merge or base):
        raise SFTError(f"{'--merge' if merge else '--base'}: {checkpoint} holds {KINDS[kind]}, not a LoRA adapter; "
                       "drop the flag")
    if base and not merge and server is None:
        raise SFTError("--base: names the model a LoRA adapter is merged into; add --merge, or drop --base")
    if server is not None:
        return _server_adapter(checkpoint, out_dir, base, overwrite)
    if kind == "lora" and not merge:
        return _copy_adapter(checkpoint, out_dir, overwrite)
    if kind == "lora":
        return _merge(checkpoint, out_dir, base, overwrite)
    check_out_dir(out_dir, {"checkpoint": checkpoint}, overwrite)
    return _export_weights(checkpoint, out_dir, kind, dtype, max_shard_size)


def _copy_adapter(checkpoint: str, out_dir: str, overwrite: bool) -> Exported:
    """The adapter's model-folder files copied; each copy's checksum must equal the one the marker recorded."""
    check_out_dir(out_dir, {"checkpoint": checkpoint}, overwrite)
    names = sorted(n for n in os.listdir(checkpoint) if MODEL_FILES.match(n)
                   and os.path.isfile(os.path.join(checkpoint, n)))

    def write(tmp: str) -> None:
        for n in names:
            shutil.copyfile(os.path.join(checkpoint, n), os.path.join(tmp, n))

    out = write_folder(out_dir, write, ".export-")
    recorded = _marker_files(checkpoint)
    bad = [n for n in names if HASH in recorded.get(n, {}) and file_digest(os.path.join(out, n)) != recorded[n][HASH]]
    if bad:
        raise ExportMismatch(f"{out}: the copies of {', '.join(bad)} differ from the checkpoint's files")
    return Exported(out, "lora", "adapter_model.safetensors", tuple(names), 0, 0.0, 0.0)


def _server_adapter(checkpoint: str, out_dir: str, base: Optional[str], overwrite: bool) -> Exported:
    """:func:`sft.model.vllm_adapter.write_vllm_adapter`, with the adapter folder's other files (tokenizer,
    generation config) copied."""
    check_out_dir(out_dir, {"checkpoint": checkpoint}, overwrite)
    names = sorted(n for n in os.listdir(checkpoint) if MODEL_FILES.match(n) and not n.startswith("adapter_")
                   and os.path.isfile(os.path.join(checkpoint, n)))
    what = []

    def write(tmp: str) -> None:
        what.append(write_vllm_adapter(checkpoint, base, tmp))
        for n in names:
            shutil.copyfile(os.path.join(checkpoint, n), os.path.join(tmp, n))

    out = write_folder(out_dir, write, ".export-")
    return Exported(out, "lora", what[0], tuple(sorted(os.listdir(out))), 0, 0.0, 0.0)


def _marker_files(checkpoint: str) -> dict:
    from sft.fsio import read_json

    return read_json(os.path.join(checkpoint, MARKER))["files"]


def _merge(checkpoint: str, out_dir: str, base: Optional[str], overwrite: bool) -> Exported:
    """:func:`sft.model.export.merge_adapter`, then the merged folder against base + adapter unmerged."""
    import json

    import torch
    import transformers
    from peft import PeftModel

    out = merge_adapter(checkpoint, out_dir, base, overwrite)
    with open(os.path.join(checkpoint, "adapter_config.json")) as f:
        base = base or json.load(f).get("base_model_name_or_path")
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    reference = auto_class_of(base).from_pretrained(base, dtype=torch.float32)
    if len(tok) > reference.get_input_embeddings().weight.shape[0]:
        reference.resize_token_embeddings(len(tok))
    with without_gptqmodel(), without_v4_moe_conversion():  # as merge_adapter
        reference = PeftModel.from_pretrained(reference, checkpoint)
    tokens, diff = _compare(out, reference, tok, MERGE_ATOL, "the base model with the checkpoint's adapter")
    return Exported(out, "lora", f"adapter_model.safetensors merged into {base}", tuple(sorted(os.listdir(out))),
                    tokens, diff, MERGE_ATOL)


def _export_weights(checkpoint: str, out_dir: str, kind: str, dtype: str, max_shard_size: str) -> Exported:
    """A full model from ZeRO shards, DCP shards or a consolidated checkpoint: loaded in float32, cast to ``dtype``,
    written with the checkpoint's tokenizer and generation config, reloaded and compared."""
    import torch
    import transformers

    fix = "give a checkpoint-N folder written by sft-train"
    with explain_load_errors("tokenizer", checkpoint, fix):
        tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    with explain_load_errors("model config", checkpoint, fix):
        config = transformers.AutoConfig.from_pretrained(checkpoint)
    if kind == "full":
        with explain_load_errors("model", checkpoint, fix):
            model = auto_class(config).from_pretrained(checkpoint, dtype=torch.float32)
        source = "model*.safetensors"
    else:
        model = auto_class(config).from_config(config, dtype=torch.float32)
        source = _load_zero(checkpoint, model) if kind == "zero" else _load_dcp(dcp_folder(checkpoint), model)
    if dtype == "auto":
        dtype = str(getattr(config, "dtype", None) or "float32").replace("torch.", "")
        dtype = dtype if dtype in DTYPES else "float32"
    target = getattr(torch, dtype)
    with torch.no_grad():  # the model keeps float32 (and its float32 buffers: rotary frequencies) with the values
        for p in model.parameters():  # the folder will hold, so that it is the reference below
            p.copy_(p.to(target))
    state, cast = {}, {}
    for k, v in model.state_dict().items():  # tied weights stay one tensor (save_pretrained writes it once)
        if v.data_ptr() not in cast:
            cast[v.data_ptr()] = v.to(target)
        state[k] = cast[v.data_ptr()]
    model.config.use_cache = True
    model.config.pad_token_id = tok.pad_token_id
    if os.path.isfile(os.path.join(checkpoint, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(checkpoint)

    def write(tmp: str) -> None:
        model.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
        model.config.dtype = target  # save_pretrained records the parameters' dtype (float32 here)
        model.config.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    out = write_folder(out_dir, write, ".export-")
    tokens, diff = _compare(out, model, tok, EXACT_ATOL, f"the checkpoint's weights ({source}, as {dtype})")
    return Exported(out, kind, source, tuple(sorted(os.listdir(out))), tokens, diff, EXACT_ATOL)


def _load_zero(checkpoint: str, model) -> str:
    """DeepSpeed's consolidation of the ZeRO shards (fp32 master weights; the tag from the ``latest`` file) into
    ``model``. Its progress lines go to stderr, so that stdout carries sft-export's own."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with open(os.path.join(checkpoint, "latest")) as f:
        tag = f.read().strip()
    with contextlib.redirect_stdout(sys.stderr), explain_load_errors(
            "DeepSpeed ZeRO shards", os.path.join(checkpoint, tag), "the shards do not form a ZeRO checkpoint"):
        state = get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag=tag)
    _load_state(model, state, checkpoint, "ZeRO")
    return f"{tag}/, written by {zero_world_size(checkpoint)} ranks"


def _load_dcp(folder: str, model) -> str:
    """Read a torch.distributed.checkpoint folder into ``model`` (in this one process, no process group: DCP
    reshards on load). Its keys are the model's, or the model's under ``model.`` (accelerate saves
    ``{"model": state dict}``); a key of the checkpoint the model lacks, or a weight of the model the checkpoint lacks
    (other than one tied to a loaded weight), is refused."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(folder)
    with explain_load_errors("torch.distributed.checkpoint metadata", folder, "the folder is not a DCP checkpoint"):
        saved = set(reader.read_metadata().state_dict_metadata)
    own = model.state_dict()
    prefix = "model." if sum(f"model.{k}" in saved for k in own) > sum(k in saved for k in own) else ""
    present = {k: v for k, v in own.items() if prefix + k in saved}
    _check_keys(model, set(present), saved - {prefix + k for k in own}, folder, "DCP")
    with explain_load_errors("torch.distributed.checkpoint shards", folder, "the shards do not fit the config"), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": present} if prefix else present, storage_reader=reader)
    shards = sum(n.endswith(".distcp") for n in os.listdir(folder))
    return f"{os.path.relpath(folder, os.path.dirname(folder.rstrip(os.sep)))}/, {shards} .distcp files"


def _load_state(model, state: dict, where: str, what: str) -> None:
    own = model.state_dict()
    _check_keys(model, set(state) & set(own), set(state) - set(own), where, what)
    with explain_load_errors(f"{what} weights", where, "the weights do not fit the checkpoint's config.json"):
        model.load_state_dict(state, strict=False)


def _check_keys(model, loaded: set, unexpected: set, where: str, what: str) -> None:
    """Every weight of ``model`` is loaded (or shares its storage with a loaded one: tied embeddings) and nothing is
    left over. Raises SFTError naming the first few keys."""
    own = model.state_dict()
    ptrs = {own[k].data_ptr() for k in loaded}
    missing = sorted(k for k in own if k not in loaded and own[k].data_ptr() not in ptrs)
    if missing or unexpected:
        what_is = (f"lacks {len(missing)} weight(s) of the model ({', '.join(missing[:3])})" if missing else
                   f"holds {len(unexpected)} tensor(s) the model has not ({', '.join(sorted(unexpected)[:3])})")
        raise SFTError(f"{where}: the {what} state {what_is}; the checkpoint's config.json does not describe these "
                       "weights (a LoRA run's shards without its adapter_config.json?)")


def probe_ids(tok) -> list[int]:
    """At most :data:`PROBE_TOKENS` token ids of :data:`PROBE`, rendered with the chat template when there is one."""
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": PROBE}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
    else:
        ids = tok(PROBE)["input_ids"]
    return list(ids)[:PROBE_TOKENS]


def _compare(out: str, reference, tok, atol: float, what: str) -> tuple[int, float]:
    """Reload ``out`` in float32 and compare its logits with ``reference``'s on :func:`probe_ids`. Returns (tokens,
    max abs diff). Raises :class:`ExportMismatch` above ``atol``."""
    import torch

    with explain_load_errors("written model", out, "report this: the folder was just written"):
        reloaded = auto_class_of(out).from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([probe_ids(tok)])
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits.float()
        want = reference.eval()(input_ids=ids).logits.float()
    diff = (got - want).abs().max().item()
    if not diff <= atol:
        raise ExportMismatch(f"{out}: reloaded with from_pretrained, its logits differ from those of {what} by up to "
                             f"{diff:.3g} on {ids.shape[1]} tokens (tolerance {atol:g}); the folder is left for "
                             "inspection; report this with SFT_DEBUG=1")
    return ids.shape[1], diff
