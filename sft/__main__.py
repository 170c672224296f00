"""``python -m sft COMMAND [ARGS...]``: train | check | merge | export | generate | show-sample | ray
(see :mod:`sft.cli`)."""
from sft.cli import command

command()
