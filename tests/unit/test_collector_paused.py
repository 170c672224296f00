"""sft.compat.python.collector_paused: the cyclic garbage collector off for a command's imports, on again after."""
import gc

import pytest

from sft.compat.python import collector_paused


def test_the_collector_is_off_inside_and_on_again_after_also_after_an_exception():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ImportError, match="no such module"):
        with collector_paused():
            raise ImportError("no such module")
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
