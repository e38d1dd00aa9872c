import gc
import signal
import time

import pytest

from marin_rl.cli import abort, redeliver_dropped_interrupts


def test_an_interrupt_dropped_inside_a_gc_callback_is_raised_again_in_the_main_thread():
    """A second Ctrl-C handled while a garbage-collector callback runs (JAX registers one) must still
    abort: raised there, Python prints and drops it ("Exception ignored in ..."), and the run would end
    as if it had not been interrupted."""
    raised_inside = []

    def on_collect(phase, _info):
        if phase == "start" and not raised_inside:
            raised_inside.append(True)
            signal.raise_signal(signal.SIGINT)  # handled here, inside the callback: dropped

    handlers = {sig: signal.signal(sig, abort) for sig in (signal.SIGINT, signal.SIGTERM)}
    restore_hook = redeliver_dropped_interrupts()
    gc.callbacks.append(on_collect)
    try:
        with pytest.raises(KeyboardInterrupt):
            gc.collect()
            time.sleep(5)
    finally:
        gc.callbacks.remove(on_collect)
        restore_hook()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert raised_inside == [True]
    assert signal.getsignal(signal.SIGINT) is handlers[signal.SIGINT]
