"""`DeviceLock`: re-entrant, first come first served, and it tells its holder when someone waits."""

import signal
import threading
import time

import pytest

from marin_rl.engine import DeviceLock


def test_waiters_are_served_in_order_and_the_holder_sees_them_waiting():
    lock, order = DeviceLock(), []
    with lock:
        with lock:  # re-entrant
            assert not lock.wanted
        threads = []
        for name in "abc":
            thread = threading.Thread(target=lambda name=name: (lock.__enter__(), order.append(name), lock.__exit__()))
            thread.start()
            while lock.waiting < len(threads) + 1:
                time.sleep(0.001)  # each waiter is in line before the next one starts
            threads.append(thread)
        assert lock.wanted and order == []
    for thread in threads:
        thread.join(timeout=10)
    assert order == ["a", "b", "c"] and not lock.wanted


def test_a_holder_that_leaves_and_comes_back_queues_behind_a_waiter():
    lock, order = DeviceLock(), []
    lock.__enter__()
    waiter = threading.Thread(target=lambda: (lock.__enter__(), order.append("waiter"), lock.__exit__()))
    waiter.start()
    while not lock.wanted:
        time.sleep(0.001)
    lock.__exit__()
    with lock:  # the waiter was first: no barging in
        order.append("holder")
    waiter.join(timeout=10)
    assert order == ["waiter", "holder"]


def test_a_waiter_interrupted_by_a_signal_leaves_the_line():
    # A second Ctrl-C raises in the main thread while it waits for the engine's turn to end; the shutdown
    # that follows must still get the lock.
    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    lock, holding, release = DeviceLock(), threading.Event(), threading.Event()
    holder = threading.Thread(target=lambda: (lock.__enter__(), holding.set(), release.wait(10), lock.__exit__()))
    holder.start()
    holding.wait(10)
    main = threading.get_ident()

    def interrupt_the_waiting_main_thread():
        while not lock.wanted:
            time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        interrupter = threading.Thread(target=interrupt_the_waiting_main_thread)
        interrupter.start()
        with pytest.raises(Interrupted):
            with lock:
                pass
        interrupter.join(timeout=10)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert lock.waiting == 0
    release.set()
    holder.join(timeout=10)
    later = threading.Thread(target=lambda: (lock.__enter__(), lock.__exit__()))
    later.start()
    later.join(timeout=10)
    assert not later.is_alive() and not lock.wanted
