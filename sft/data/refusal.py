"""A conversation refused: :class:`Refusal`, the one value that says at which turn, what happened and the fix, given in
place of a conversation's samples (:func:`sft.data.encode.samples.encode_samples`) or raised; a record problem names it
(:func:`sft.data.records.records.template_problem`)."""
from __future__ import annotations

from typing import Optional

from sft.errors import TemplateError

TEMPLATE_KIND = "refused by the template"  # a refusal's kind unless it says another (sft-check counts problems by kind)
TEMPLATE_FIX = "use another chat template"  # the fix of a template failure that names none


class Refusal(TemplateError):
    """One conversation refused (a :class:`~sft.errors.TemplateError`: exit 2 where it stops a run).

    Attributes:
        turn: the index of the message it is about, as the record numbers its turns once :meth:`renumber` ran
            (None: the whole conversation).
        what: what happened, one line.
        fix: how to fix it, one line.
        kind: the problem's kind in the record check's counts (default :data:`TEMPLATE_KIND`).

    Its message is ``"turn T: what; fix"`` (``"what; fix"`` without a turn), ``T`` as numbered when it was made.
    """

    def __init__(self, turn: Optional[int], what: str, fix: str, kind: str = TEMPLATE_KIND):
        super().__init__(f"turn {turn}: {what}; {fix}" if turn is not None else f"{what}; {fix}")
        self.turn, self.what, self.fix, self.kind = turn, what, fix, kind

    def renumber(self, shift: int) -> None:
        """Number :attr:`turn` as the record does: ``shift`` messages (a default system prompt) were added in front
        of the record's own; the message keeps the numbering it was made with."""
        if self.turn is not None:
            self.turn -= shift


def refusal_of(error: TemplateError) -> Refusal:
    """``error`` as a :class:`Refusal`: itself, or (a template failure that names no turn, e.g. a rendering that
    fails) the whole conversation refused, its message as what happened and :data:`TEMPLATE_FIX` as the fix."""
    return error if isinstance(error, Refusal) else Refusal(None, str(error), TEMPLATE_FIX)
