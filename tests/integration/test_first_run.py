"""A new user's first runs through the real `marin-rl` command: a quiet end, an own env that just
imports, a double Ctrl-C; the viewer is tested in test_viewer_browser.py on the run made here."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from marin_rl.storage import read_rollouts
from marin_rl.testing import QUICK_RUN, run_command

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")

pytestmark = pytest.mark.slow

MY_ENV = '''
from marin_rl.envs import Env, Problem, SamplingParams, reward


class MyEnv(Env):
    """Say the letter after the one given."""

    sampling = SamplingParams(max_tokens=1)

    def problems(self):
        while True:
            for c in "abcdefgh":
                yield Problem(id=c, prompt=c, answer=chr(ord(c) + 1))

    @reward
    def correct(self, completion, answer):
        return float(completion[:1] == answer)
'''


def assert_quiet(stderr: str, last: str | None = None) -> None:
    """No traceback and no error: at most logged warnings (a slow first batch), then `last`."""
    lines = stderr.splitlines()
    if last is not None:
        assert lines and lines.pop() == last, stderr
    assert all(re.match(r"^[\d-]+ [\d:,]+ WARNING ", line) for line in lines), stderr


def test_a_short_run_ends_quietly(quickstart_run):
    run_dir, done = quickstart_run
    assert done.returncode == 0, done.stderr
    assert_quiet(done.stderr)  # no tracebacks from requests in flight
    assert "done at step 3" in done.stdout and "env addition (toy_addition): prompts 7 tokens" in done.stdout
    assert (run_dir / "checkpoints" / "step-3").is_dir()


def test_an_own_env_next_to_the_config_imports_without_pythonpath(tmp_path):
    (tmp_path / "my_env.py").write_text(MY_ENV)
    config = Path(QUICKSTART).read_text()
    config = config.replace("type: toy_addition", "type: my_env:MyEnv").replace("args: {addends: [1]}", "args: {}")
    (tmp_path / "my_run.yaml").write_text(config)
    done = run_command(["train", "my_run.yaml", "--run_dir=runs/mine", "--max_steps=2", *QUICK_RUN], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert_quiet(done.stderr)
    rollouts = read_rollouts(tmp_path / "runs" / "mine", env="addition")
    assert rollouts and {r.problem_id for r in rollouts} <= set("abcdefgh")


def test_a_second_ctrl_c_exits_at_once_without_a_traceback(tmp_path):
    run_dir = tmp_path / "run"
    script = Path(sys.executable).with_name("marin-rl")
    args = ["train", QUICKSTART, f"--run_dir={run_dir}", "--max_steps=1000", *QUICK_RUN]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each line as it is printed
    process = subprocess.Popen([script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err, stopping = [], [], threading.Event()

    def read(stream, lines):
        with stream:
            for line in stream:
                lines.append(line)
                if "SIGINT: finishing the step" in line:
                    stopping.set()

    readers = [threading.Thread(target=read, args=pair) for pair in ((process.stdout, out), (process.stderr, err))]
    for reader in readers:
        reader.start()
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert process.poll() is None, "".join(err)
            assert time.monotonic() < deadline, "no training step within 300 s"
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        assert stopping.wait(60), "".join(out)
        process.send_signal(signal.SIGINT)  # while the first one's clean-up runs
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after the second Ctrl-C:\n{''.join(out + err)}")
    finally:
        process.kill()  # a hung run must not outlive the test (nor keep CI waiting on its pipes)
        process.wait()
        for reader in readers:
            reader.join()
    assert process.returncode == 130, "".join(out + err)
    assert_quiet("".join(err), last="aborted: the rollouts are on disk; the final checkpoint was not written")
    assert read_rollouts(run_dir, env="addition")  # what was pending got written
