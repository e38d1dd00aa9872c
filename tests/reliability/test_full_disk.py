"""A run whose disk fills up: one line naming the path and the free bytes, the checkpoints intact, and
once there is room again `--resume` finishes the run.

The disk is a 6 MiB tmpfs mounted in a user and mount namespace of its own (`unshare`), so nothing
outside the test sees it.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from marin_rl.learner._checkpoint import complete_checkpoints

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MARIN_RL = Path(sys.executable).with_name("marin-rl")
SCRIPT = """
set -u
mount -t tmpfs -o size=6m tmpfs "$DISK"
"$MARIN_RL" train configs/quickstart.yaml --run_dir="$DISK/run" --max_steps=60 --checkpoint_every=5 >"$OUT/full.out" 2>"$OUT/full.err"
echo $? >"$OUT/full.rc"
ls "$DISK/run/checkpoints" >"$OUT/checkpoints"
cp -r "$DISK/run/checkpoints" "$OUT/checkpoints-after-failure"
mount -o remount,size=64m "$DISK"  # the user frees some space
"$MARIN_RL" train configs/quickstart.yaml --run_dir="$DISK/run" --max_steps=60 --checkpoint_every=5 --resume >"$OUT/resume.out" 2>"$OUT/resume.err"
echo $? >"$OUT/resume.rc"
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare to mount a small tmpfs")
def test_a_full_disk_is_named_in_one_line_and_the_run_resumes_once_there_is_room(tmp_path):
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    env = {"DISK": str(disk), "OUT": str(out), "MARIN_RL": str(MARIN_RL), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr
    err = (out / "full.err").read_text()
    assert (out / "full.rc").read_text().strip() == "1", err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    match = re.fullmatch(rf"error: the disk is full: could not write {re.escape(str(disk))}/run/(\S+) \(([\d,]+) bytes free there\)", lines[0])
    assert match, lines[0]
    print(f"full disk: {lines[0]}")
    # The checkpoints written before are whole (no partial one left behind) and the resumed run uses the newest.
    kept = complete_checkpoints(out / "checkpoints-after-failure")
    assert kept and (out / "checkpoints").read_text().split() == [p.name for p in kept]
    newest = kept[-1].name
    assert (out / "resume.rc").read_text().strip() == "0", (out / "resume.err").read_text()[-3000:]
    resumed = (out / "resume.out").read_text()
    assert f"resuming from {disk}/run/checkpoints/{newest}" in resumed and "done at step 60" in resumed
