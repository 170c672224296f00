"""``python -m sft COMMAND [ARGS...]``: train | check | merge | export | generate | show-sample | ray
(see :mod:`sft.cli`)."""
import sys

from sft.cli import main

sys.exit(main())
