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


class _Metadata:
    """Pytree metadata whose comparison is interrupted, as a Ctrl-C landing inside it would be."""

    def __eq__(self, other):
        raise KeyboardInterrupt

    def __hash__(self):
        return 0


class _Node:
    def __init__(self, metadata):
        self.metadata = metadata


def _interrupted_treedef_comparison():
    import jax

    jax.tree_util.register_pytree_node(_Node, lambda node: ((), node.metadata), lambda metadata, _: _Node(metadata))
    return jax.tree.structure(_Node(_Metadata())) != jax.tree.structure(_Node(_Metadata()))


def test_a_second_ctrl_c_that_a_library_wraps_still_aborts_with_130(monkeypatch, capsys):
    """JAX turns a KeyboardInterrupt raised inside a pytree metadata `__eq__` into a ValueError: the run
    must still end as aborted (exit 130, one line), not with that ValueError's traceback."""
    from marin_rl import cli

    def handler(args, console):
        _interrupted_treedef_comparison()

    monkeypatch.setattr(cli, "plot_command", handler)
    assert cli.main(["plot", "nowhere"]) == cli.INTERRUPTED
    assert capsys.readouterr().err.startswith("aborted: the rollouts are on disk")


def test_an_error_not_caused_by_an_interrupt_is_not_taken_for_one(monkeypatch):
    from marin_rl import cli

    def handler(args, console):
        raise ValueError("a real bug")

    monkeypatch.setattr(cli, "plot_command", handler)
    with pytest.raises(ValueError, match="a real bug"):
        cli.main(["plot", "nowhere"])
