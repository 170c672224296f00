"""``sft-check``: the configuration and every data record, without training (what the launchers run once before
starting several processes)."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from sft.app.specs import control_tokens_for, data_sources, preparation_spec
from sft.app.validation import validate
from sft.config.arguments import parse_args
from sft.data.encode.samples import encode_samples, lazy_refusal
from sft.data.records.eval_split import empty_side_error, in_eval, record_key
from sft.data.records.records import RecordCheck, iter_conversations, template_problem
from sft.distributed.expert_parallel import check_expert_parallel_size
from sft.distributed.process_group import check_sequence_parallel_size
from sft.errors import ConfigError
from sft.model.loading import load_tokenizer


def check_data(model_args, data_args, training_args) -> list[str]:
    """What ``sft-check`` and the launchers check before starting several processes: the tokenizer loads and every
    record of ``--data_path`` / ``--eval_data_path`` is valid (streamed in one process: memory does not grow
    with the records). Returns one summary line per source.

    Raises:
        SFTError: as :func:`control_tokens_for`, :func:`sft.data.records.records.RecordCheck.finish` and
            :func:`sft.model.loading.load_tokenizer`.
    """

    tok, eot, _ = load_tokenizer(model_args.model_name_or_path, model_args.trust_remote_code, training_args.cache_dir,
                                 model_args.chat_template, model_args.chat_template_kwargs)
    control = control_tokens_for(tok, data_args.system_message)

    lines, ratio = [], data_args.eval_split_ratio
    split = ratio is not None and not data_args.eval_data_path
    sources = data_sources(data_args)
    spec = preparation_spec(data_args, training_args)
    limit = None if data_args.check_all_records else CHECK_ENCODED
    for path in sources["train"] + ([] if split else sources["eval"]):
        check, held, batch, encoded = RecordCheck(path), 0, [], 0
        for conv in iter_conversations(path, check, control):
            held += split and in_eval(record_key(conv), ratio, data_args.eval_split_seed)
            if limit is None or encoded < limit:
                batch.append(conv)
                encoded += 1
                if len(batch) == 256:
                    _encode(tok, eot, spec, path, check, batch)
        _encode(tok, eot, spec, path, check, batch)
        check.finish(data_args.on_bad_record)
        how = (f"; all {encoded} encoded with the chat template" if limit is None or encoded < limit else
               f"; the first {encoded} encoded with the chat template (--check_all_records True for all)")
        if not split:
            lines.append(f"{path}: {check.valid} valid conversations{how}")
            continue
        if held in (0, check.valid):
            raise empty_side_error(path, ratio, check.valid, held_all=held > 0)
        lines.append(f"{path}: {check.valid} valid conversations ({check.valid - held} for training, {held} held out "
                     f"for evaluation by --eval_split_ratio {ratio}){how}")
    return lines


CHECK_ENCODED = 1000  # records per source that sft-check encodes unless --check_all_records True


def _encode(tok, eot: int, spec, path: str, check, batch: list) -> None:
    """Encode ``batch`` (conversations) as training does; the chat template's refusals become record problems in
    ``check``. Empties ``batch``."""

    if not batch:
        return
    out = encode_samples(tok, [c.messages for c in batch], eot, spec, [c.tools for c in batch])
    for c, samples in zip(batch, out):
        if not isinstance(samples, Exception) and spec.lazy and len(samples) > 1:
            samples = lazy_refusal(len(samples))  # what LazySupervisedDataset refuses when it reads the record
        if isinstance(samples, Exception):
            check.valid -= 1
            check.add([template_problem(path, c, samples)])
    batch.clear()


def check_parsed(model_args, data_args, training_args, lora_args,
                 world_sizes: Optional[Sequence[int]] = None) -> list[str]:
    """Check parsed arguments, the job's shape (:func:`launch_shape` at ``world_sizes``, the world sizes the job may
    run at; None: ``SFT_WORLD_SIZES`` as finetune/launch.sh sets it, or unknown) and every data record without
    training (what ``sft-check``, the launcher and the Ray driver do once before starting several processes).
    Returns the summary lines.

    Raises:
        SFTError: the first kind of problem found (every problem of that kind is listed).
    """

    validate(model_args, data_args, training_args, lora_args)
    if world_sizes is None:
        world_sizes = [int(w) for w in os.environ.get(WORLD_SIZES_ENV, "").split() if w.isdigit()]
    launch_shape(model_args, training_args, world_sizes)
    return check_data(model_args, data_args, training_args) + ["configuration and data OK"]


WORLD_SIZES_ENV = "SFT_WORLD_SIZES"  # set by finetune/launch.sh for its check: the job's possible world sizes


def launch_shape(model_args, training_args, world_sizes: Sequence[int]) -> None:
    """What every training process would refuse about the job's shape, refused by the launcher's check before torchrun
    starts, with the ranks' own rules: ``--expert_parallel_size`` and ``--sequence_parallel_size`` must divide every
    world size the job may run at (``world_sizes``; an elastic job's at each node count;
    :func:`sft.distributed.expert_parallel.check_expert_parallel_size`,
    :func:`sft.distributed.process_group.check_sequence_parallel_size`), and ``--sequence_parallel_mode ulysses``
    needs heads it can split (:func:`sft.model.sequence_parallel.choose_mode`, on the model's config). Nothing is
    checked without world sizes (a lone ``sft-check``: the world is unknown).

    Raises:
        ConfigError: one line, naming the flag, the value and the fix.
    """
    for world in world_sizes:  # the rest of --expert_parallel_size's rules: validate() (sft.app.expert_parallel)
        check_expert_parallel_size(training_args.expert_parallel_size, world)
    size = training_args.sequence_parallel_size
    if size <= 1 or not world_sizes:
        return
    for world in world_sizes:
        check_sequence_parallel_size(size, world)
    if training_args.sequence_parallel_mode == "ulysses":
        from transformers import AutoConfig

        from sft.model.sequence_parallel import choose_mode

        try:
            config = AutoConfig.from_pretrained(model_args.model_name_or_path,
                                                trust_remote_code=model_args.trust_remote_code)
        except (OSError, ValueError) as e:  # the model's own loading reports it, in its words
            raise ConfigError([f"--model_name_or_path {model_args.model_name_or_path}: no readable config.json "
                               f"({str(e).splitlines()[0]})"]) from None
        choose_mode(config, size, "ulysses")


def check(argv: Optional[Sequence[str]] = None, extra: tuple = ()) -> list[str]:
    """Parse ``argv`` and :func:`check_parsed` it. Returns the summary lines."""

    return check_parsed(*parse_args(argv, extra)[:4])
