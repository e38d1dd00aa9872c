"""Checkpoints under `RUN/checkpoints/step-N/`: model and optimizer state as Equinox leaf files, a JSON
sidecar, and a completion marker. No pickle.

Each checkpoint is written into a temporary sibling directory, fsynced, marked complete, and renamed into
place, so a crash leaves either the whole checkpoint or none; the latest is the highest N that has the marker.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

import equinox as eqx

from marin_rl.errors import naming_full_disk
from marin_rl.learner._files import fsync_tree, replace_dir

MODEL_FILE = "model.eqx"
OPT_STATE_FILE = "opt_state.eqx"
STATE_FILE = "state.json"
COMPLETE_MARKER = "COMPLETE"
_CHECKPOINT_DIR = re.compile(r"step-(\d+)")


def save_checkpoint(directory: Path, step: int, *, model, opt_state, state: dict, keep: int) -> Path:
    """Write checkpoint `step` (model, optimizer state, JSON-able `state`) and delete all but the newest
    `keep` complete checkpoints. Returns the checkpoint's directory."""
    final = directory / f"step-{step}"
    tmp = directory / f".tmp-step-{step}-{uuid.uuid4().hex}"
    with naming_full_disk(final):  # outside the clean-up: the free bytes it names are those left after it
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            eqx.tree_serialise_leaves(tmp / MODEL_FILE, model)
            eqx.tree_serialise_leaves(tmp / OPT_STATE_FILE, opt_state)
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
            (tmp / COMPLETE_MARKER).write_text("")
            fsync_tree(tmp)
            replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # the older checkpoints are kept whole
            raise
    for old in complete_checkpoints(directory)[:-keep]:
        shutil.rmtree(old)
    return final


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _CHECKPOINT_DIR.fullmatch(path.name)
        if match and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def load_checkpoint(path: Path, *, model_like, opt_state_like, check_state=None):
    """(model, opt_state, state dict) of the checkpoint at `path`; the `*_like` trees give structure and
    shapes (the current model and optimizer state). `check_state(state)` may refuse it (raise) before
    any array is read."""
    state = json.loads((path / STATE_FILE).read_text())
    if check_state is not None:
        check_state(state)
    try:
        model = eqx.tree_deserialise_leaves(path / MODEL_FILE, model_like)
        opt_state = eqx.tree_deserialise_leaves(path / OPT_STATE_FILE, opt_state_like)
    except Exception as e:
        raise ValueError(
            f"checkpoint {str(path)!r} does not match the current model/optimizer (was it written with "
            f"another ModelConfig? it records {state.get('config')}): {e}"
        ) from e
    return model, opt_state, state
