"""`DeviceLock`: turns on a device that the learner and an engine share."""

from __future__ import annotations

import collections
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
        self._line: collections.deque[object] = collections.deque()

    def __enter__(self) -> DeviceLock:
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:
                self._depth += 1
                return self
            place = object()
            self._line.append(place)
            try:
                while self._owner is not None or self._line[0] is not place:
                    self._cv.wait()
            except BaseException:
                # A second Ctrl-C lands here while the engine holds the lock: leave the line, or everyone
                # behind this place waits forever (the shutdown joining the engine thread included).
                self._line.remove(place)
                self._cv.notify_all()
                raise
            self._line.popleft()
            self._owner, self._depth = me, 1
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
        return len(self._line)

    @property
    def wanted(self) -> bool:
        return self.waiting > 0
