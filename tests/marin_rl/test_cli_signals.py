import gc
import signal
import time

import pytest

from marin_rl.cli import deferred_past_gc


def test_an_interrupt_raised_inside_a_gc_callback_is_delivered_after_it():
    """A second Ctrl-C handled while a garbage-collector callback runs (JAX registers one) must still
    abort: raised there, Python would print and drop it, and the run would end as if not interrupted."""
    deferred = []

    def handler(signum, frame):  # `marin-rl train`'s second Ctrl-C
        deferred.append(deferred_past_gc(signum, frame))
        if not deferred[-1]:
            raise KeyboardInterrupt

    def on_collect(phase, _info):
        if phase == "start" and not deferred:
            signal.raise_signal(signal.SIGINT)  # handled here, inside the callback

    previous = signal.signal(signal.SIGINT, handler)
    gc.callbacks.append(on_collect)
    try:
        with pytest.raises(KeyboardInterrupt):
            gc.collect()
            time.sleep(5)
    finally:
        gc.callbacks.remove(on_collect)
        signal.signal(signal.SIGINT, previous)
    assert deferred == [True, False]
