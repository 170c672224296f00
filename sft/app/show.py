"""``sft-show-sample``: the rendered training sample(s) of one record, supervised tokens marked."""
from __future__ import annotations

import itertools
import os
from typing import Iterator, Optional

from sft.data.encode.cut_turns import cut_turn_text
from sft.data.encode.samples import encode_samples
from sft.data.records.records import RecordCheck, iter_conversations, template_problem
from sft.data.spec import PreparationSpec
from sft.data.template.chat import visualize
from sft.errors import DataError, SFTError
from sft.model.loading import load_tokenizer


def show_sample(model_dir: str, data_file: str, index: int = 0, spec: PreparationSpec = PreparationSpec(max_len=8192),
                color: bool = False, chat_template: Optional[str] = None,
                chat_template_kwargs: Optional[str] = None) -> Iterator[str]:
    """Yield, per training sample of the ``index``-th valid record (0-based) of ``data_file``: a header line (record
    index and id, tokens, supervised tokens, truncation) and the rendered text with supervised tokens marked «like
    this» (ANSI colour instead when ``color``). Several samples when a long conversation is split, or when the chat
    template renders earlier turns differently once later turns exist (:mod:`sft.data.encode.turns`). ``spec``: the data
    preparation as training does it (its ``max_len``, ``system_message``, ``long_conversations``,
    ``last_reply_only`` and ``allow_dropped_content``: ``--model_max_length``, ``--system_message``,
    ``--long_conversations``, ``--mask_history``, ``--allow_dropped_content``); ``chat_template`` /
    ``chat_template_kwargs``: as ``--chat_template`` / ``--chat_template_kwargs``.

    The file is streamed up to the record asked for: a huge file is not loaded.

    Raises:
        SFTError: ``model_dir`` is not a model folder, ``spec.max_len`` < 8, ``index`` < 0 or past the last valid
            record; DataError: the chat template refuses the record (its problem: file, record, turn, fix); and as
            :func:`sft.model.loading.load_tokenizer` / :class:`sft.data.records.records.RecordCheck`.
    """
    if not os.path.isfile(os.path.join(model_dir, "config.json")) and not os.path.isfile(
            os.path.join(model_dir, "tokenizer.json")):
        raise SFTError(f"{model_dir}: not a model folder (no config.json or tokenizer.json)")
    if spec.max_len < 8:
        raise SFTError(f"--model_max_length {spec.max_len}: must be at least 8")
    if index < 0:
        raise SFTError(f"--index {index}: must be 0 or more (it counts valid records from 0)")
    check = RecordCheck(data_file)
    c = next(itertools.islice(iter_conversations(data_file, check), index, None), None)
    if c is None:
        raise SFTError(f"--index {index}: the file has {check.valid} valid records")
    tok, eot, _ = load_tokenizer(model_dir, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
    samples = encode_samples(tok, [c.messages], eot, spec, [c.tools])[0]
    if isinstance(samples, Exception):
        raise DataError(str(template_problem(data_file, c, samples)))
    for k, ex in enumerate(samples):
        part = f" sample {k + 1} of {len(samples)}:" if len(samples) > 1 else ""
        yield (f"record {c.index} id={c.id}:{part} {len(ex['input_ids'])} tokens, {ex['n_supervised']} supervised"
               + (f", truncated ({ex['n_lost']} supervised tokens lost; cut in {cut_turn_text(ex)})" if ex["truncated"]
                  else "")
               + (f", {ex['user_cut']} user turn(s) too long for --model_max_length {spec.max_len} cut from the "
                  "start (their last words kept)" if ex.get("user_cut") else ""))
        yield visualize(tok, ex["input_ids"], ex["labels"], color=color)

