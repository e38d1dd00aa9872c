"""`DeviceLock`: re-entrant, first come first served, and it tells its holder when someone waits."""

import threading
import time

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
