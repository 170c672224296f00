"""Reading labels back in tests: the decoded runs of supervised tokens."""
from sft.data.template.chat import IGNORE_INDEX


def supervised_spans(tok, ids, labels) -> list[str]:
    """Decoded runs of consecutive supervised tokens (one per supervised reply: its content + end of turn).
    Asserts that every supervised label equals its input id."""
    spans, run = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            assert lab == i
            run.append(i)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans + ([tok.decode(run)] if run else [])


def split_reused_and_fresh(tok, eot, messages, tools, max_len: int, monkeypatch) -> tuple[list, list, int, int]:
    """:func:`sft.data.encode.split_turns.split_turns` of one conversation twice: as preparation runs it (replies taken
    from the whole conversation's plan and from earlier pieces with the same first unit) and with every piece planned
    from scratch: ``(pieces, fresh pieces, renderings, fresh renderings)``."""
    import sft.data.encode.split_turns as split_mod
    import sft.data.encode.turns as turns_mod
    from sft.data.encode.turns import plan, stop_tokens, trained_turns

    stops = stop_tokens(tok, eot)
    closing = frozenset(tok.convert_tokens_to_ids(stops)) if len(stops) > 1 else eot
    options = split_mod.SplitOptions(max_len, stops, closing)
    known = split_mod.Known(plan(tok, messages, tools, stops))
    real_render, real_plan, count = turns_mod.render_with_tools, split_mod.plan, [0]

    def counted(*a, **kw):
        count[0] += 1
        return real_render(*a, **kw)

    monkeypatch.setattr(turns_mod, "render_with_tools", counted)
    reused = split_mod.split_turns(tok, messages, tools, trained_turns(messages), options, known)
    renders, count[0] = count[0], 0
    monkeypatch.setattr(split_mod, "plan", lambda tok_, m, tl, st, known=None, count_dropped=True: real_plan(
        tok_, m, tl, st))
    fresh = split_mod.split_turns(tok, messages, tools, trained_turns(messages), options, known)
    return reused, fresh, renders, count[0]


def template_copy(tok, template: str):
    """A copy of ``tok`` (a session fixture's tokenizer) with another chat template: the Rust vocabulary is shared,
    the Python-side containers (special tokens, init kwargs, added tokens) are copied, so that setting a template or
    a special token on the copy never reaches ``tok``. ~0.1 ms instead of ~1.4-2.7 s for ``copy.deepcopy`` of the
    151,646-token Qwen vocabulary; adding tokens to the copy would reach the shared vocabulary (deepcopy for that)."""
    import copy

    out = copy.copy(tok)
    out.__dict__.update({k: copy.copy(v) for k, v in tok.__dict__.items() if isinstance(v, (dict, list, set))})
    out.chat_template = template
    return out
