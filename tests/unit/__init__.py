"""Unit tier: in process and fast (pure functions, validation, rendering, masks, data checks, contract parsing,
placement rules); no subprocesses, no training runs (a trainer may be built, not trained).
``bash scripts/test.sh tests/unit``."""
