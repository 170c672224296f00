"""Reading labels back in tests: the decoded runs of supervised tokens."""
from sft.data.chat import IGNORE_INDEX


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
