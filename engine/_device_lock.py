"""`DeviceLock`: turns on a device that the learner and an engine share."""

from __future__ import annotations

import threading


class DeviceLock:
    """A re-entrant lock served first come, first served, that tells its holder when another thread waits.

    The engine keeps it across its pipelined device calls (one decode chunk queued behind the one
    running) and lets go as soon as the learner asks (`wanted`); the learner then gets it before the
    engine's next turn, since waiters are served in order.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._owner: int | None = None
        self._depth = 0
        self._next_ticket = 0
        self._now_serving = 0

    def __enter__(self) -> DeviceLock:
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:
                self._depth += 1
                return self
            ticket = self._next_ticket
            self._next_ticket += 1
            while self._owner is not None or self._now_serving != ticket:
                self._cv.wait()
            self._owner, self._depth = me, 1
            self._now_serving += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cv:
            if self._owner != threading.get_ident():
                raise RuntimeError("DeviceLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cv.notify_all()

    @property
    def waiting(self) -> int:
        """Threads waiting for the lock."""
        return self._next_ticket - self._now_serving

    @property
    def wanted(self) -> bool:
        return self.waiting > 0
