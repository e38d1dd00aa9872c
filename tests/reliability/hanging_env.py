"""The quickstart's task with a verifier that hangs on 1 call in `hang_every` (`marin-rl train` loads
it by file path: `type: tests/reliability/hanging_env.py:HangingAddition`).

Hangs alternate between the two kinds real verifiers show: stuck in Python code (a pathological
parse; the timeout interrupts it) and blocked in C (a read without a timeout, here
`c_hang_s` long; it keeps its thread until it returns)."""

import itertools
import threading
import time

from marin_rl.envs import ToyAdditionEnv, reward


class HangingAddition(ToyAdditionEnv):
    def __init__(self, hang_every: int = 50, c_hang_s: float = 20.0, **kwargs):
        super().__init__(**kwargs)
        self.hang_every, self.c_hang_s = hang_every, c_hang_s
        self._calls = itertools.count()  # next() is atomic under the GIL
        self._lock = threading.Lock()
        self.hangs = {"python": 0, "c": 0}

    @reward
    def correct(self, completion: str, answer: str) -> float:
        call = next(self._calls)
        if call % self.hang_every == self.hang_every - 1:
            kind = "c" if (call // self.hang_every) % 2 else "python"
            with self._lock:
                self.hangs[kind] += 1
            if kind == "c":
                threading.Event().wait(self.c_hang_s)
            else:
                while True:
                    time.sleep(0.001)
        return super().correct(completion, answer)
