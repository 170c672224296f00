"""Unit tier: in-process and fast (pure functions, validation, rendering, masks, data checks, contract parsing,
placement rules); no subprocesses, no training runs beyond a few in-process steps. ``bash scripts/test.sh tests/unit``."""
