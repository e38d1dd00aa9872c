import gc
import sys

import pytest

from marin_rl.interpreter import DEFAULT_SWITCH_INTERVAL_S, SWITCH_INTERVAL_S, tune_interpreter


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_tuning_shortens_gil_turns_freezes_start_up_objects_and_is_undone(backend):
    interval, frozen = sys.getswitchinterval(), gc.get_freeze_count()
    undo = tune_interpreter(backend)
    try:
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S.get(backend, DEFAULT_SWITCH_INTERVAL_S))
        assert sys.getswitchinterval() < interval
        assert gc.get_freeze_count() > frozen
    finally:
        undo()
    assert sys.getswitchinterval() == interval
    assert gc.get_freeze_count() == 0
