"""The interpreter's settings for a process that trains or serves: one engine thread must keep a device
fed while other threads (env workers, the HTTP server, the learner) run Python beside it."""

from __future__ import annotations

import gc
import sys
from typing import Callable

# The switch interval, by platform. On a GPU the engine thread must feed the device: 0.5 -> 0.1 ms took
# the 0.5B loop's prefill calls from 39.8 to 23.7 ms and the learner's wait from 0.60 to 0.55 (H100). On
# a CPU the threads share the cores: 0.1 ms made the quickstart's step 8% slower than 0.5 ms.
SWITCH_INTERVAL_S = {"gpu": 0.0001}
DEFAULT_SWITCH_INTERVAL_S = 0.0005


def tune_interpreter(backend: str) -> Callable[[], None]:
    """Start-up's objects out of the collector's sight and shorter turns on the GIL; returns what undoes
    both (so that runs in one process leave nothing behind)."""
    # What start-up made (modules, compiled functions, the model) lives as long as the process: frozen,
    # full collections stop pausing every thread for 0.3-0.4 s every ~20 quickstart steps.
    gc.freeze()
    # A thread that wants the GIL waits up to the switch interval (5 ms by default) for the holder to let
    # go, several times per engine call and per HTTP request.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S.get(backend, DEFAULT_SWITCH_INTERVAL_S))

    def undo() -> None:
        gc.unfreeze()
        sys.setswitchinterval(interval)

    return undo
