"""Mistakes are reported before anything is built: exit 2, one line naming the key, no run directory."""

import subprocess
import sys
from pathlib import Path

import pytest

from marin_rl.cli import main
from marin_rl.config import load_config
from marin_rl.errors import ConfigError
from marin_rl.orchestrator import _train
from marin_rl.engine._scheduler import MIN_PREFILL_TIME, bucket
from marin_rl.orchestrator._preflight import CPU_PREFILL_ROWS, check_run, engine_shapes, prefill_rows, prompts_in_flight

QUICKSTART = "configs/quickstart.yaml"

NEEDS_A_PACKAGE = """
from marin_rl.envs import Env
from marin_rl.envs._optional import import_optional


class NeedsPackage(Env):
    def __init__(self):
        import_optional("marin_rl_no_such_package", "no-such-package", "needs_package")
"""


@pytest.fixture
def nothing_is_built(monkeypatch):
    """Fails the test if the run gets past the checks (the model, server and workers are built in `_train`)."""

    def built(*args, **kwargs):
        raise AssertionError("the run was set up although the config is wrong")

    monkeypatch.setattr(_train, "_train", built)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--envs.addition.type=toy_adition"], "envs.0.type: unknown env type 'toy_adition' (did you mean 'toy_addition'?)"),
        (["--envs.addition.args.addend=[1]"], "envs.0.args: env type 'toy_addition': got an unexpected keyword argument 'addend' (arguments of ToyAdditionEnv: ['addends', 'modulus', 'seed'])"),
        (["--envs.addition.type=needs_package.py:NeedsPackage", "--envs.addition.args={}"], "envs.0.type: env type 'needs_package' needs the package 'no-such-package'"),
        (["--learner.optimizer.learning_rate=fast"], "command line: learner.optimizer.learning_rate: 'fast' is not a number"),
        (["--learner.optimizer.learning_rat=1e-3"], "command line: learner.optimizer.learning_rat: unknown key (did you mean 'learning_rate'?)"),
        (["--envs.addition.type=exact_match", "--envs.addition.args={data: missing.jsonl}"], "envs.0: env 'addition' could not produce problems: FileNotFoundError: problem spec 'missing.jsonl': no file missing.jsonl"),
        (["--batcher.max_seq_len=6"], "envs.0: the prompt of problem '6+1' is 7 tokens after the chat template, and batcher.max_seq_len=6 leaves no room to sample"),
        (["--envs.addition.group_size=400"], "envs.0.group_size: a group of 400 rollouts of at least 8 tokens does not fit in one batch of batcher.total_token_budget=2560 (40 rows of 64)"),
        (["--envs.addition.reward_weights={correct: 1, format: 1}"], "envs.0: env 'addition': reward_weights names unknown rewards ['format']; has ['correct']"),
        (["--tokenizer=no/such/dir"], "tokenizer: 'no/such/dir' is not a local tokenizer directory"),
        (["--model.num_heads=3"], "model.hidden_dim (64) must be a multiple of model.num_heads (3)"),
        (["--model.hf_checkpoint=."], "model.hf_checkpoint: '.' has no config.json"),
    ],
)
def test_a_mistake_is_one_line_exit_2_and_leaves_no_directory(tmp_path, monkeypatch, capsys, nothing_is_built, overrides, message):
    config = tmp_path / "quickstart.yaml"
    config.write_text(Path(QUICKSTART).read_text())
    (tmp_path / "needs_package.py").write_text(NEEDS_A_PACKAGE)
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(config), "--run_dir=runs/q", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "runs").exists()


def test_a_run_dir_holding_a_run_is_refused_and_left_as_it_was(tmp_path, capsys, nothing_is_built):
    run_dir = tmp_path / "run"
    (run_dir / "rollouts" / "addition").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", QUICKSTART, f"--run_dir={run_dir}"]) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.rglob("*")) == ["addition", "metrics.jsonl", "rollouts"]


def test_a_start_that_fails_after_the_checks_leaves_nothing_behind(tmp_path, monkeypatch):
    def fails_to_start(config, run_dir, *args):
        (run_dir / "rollouts" / "addition").mkdir(parents=True)  # what the buffers create on set-up
        raise RuntimeError("out of memory while building the model")

    monkeypatch.setattr(_train, "_train", fails_to_start)
    config = load_config(QUICKSTART, [f"--run_dir={tmp_path / 'new' / 'run'}"])
    for _ in range(2):  # the retry is not refused as "already holds a run"
        with pytest.raises(RuntimeError, match="out of memory"):
            _train.train(config)
        assert not (tmp_path / "new" / "run").exists()
    # A directory the user made is kept (only what the failed start wrote is gone) and can be reused.
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(RuntimeError):
        _train.train(load_config(QUICKSTART, [f"--run_dir={mine}"]))
    assert mine.is_dir() and not _train.holds_run(mine)
    assert _train.check_run_dir(mine, resume=True) is None  # nothing to resume: a resumed start begins at step 0


def test_the_command_exits_2_without_a_traceback_and_debug_raises(tmp_path):
    command = [sys.executable, "-m", "marin_rl.cli", "train", QUICKSTART, f"--run_dir={tmp_path / 'run'}", "--envs.addition.type=nope"]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.startswith("error: envs.0.type: unknown env type 'nope'") and plain.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="unknown env type 'nope'"):  # --debug: the exception, with its traceback
        main(["--debug", *command[3:]])


def test_resume_says_which_checkpoint_it_starts_from(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    for step in (2, 4):
        (run_dir / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step-{step}" / "COMPLETE").write_text("")
    (run_dir / "checkpoints" / "step-6").mkdir()  # not complete: a crash while writing it
    monkeypatch.setattr(_train, "_train", lambda config, run_dir, *args: _train.TrainResult(run_dir, 5, False))
    assert main(["train", QUICKSTART, f"--run_dir={run_dir}", "--resume", "--max_steps=5"]) == 0
    assert f"resuming from {run_dir / 'checkpoints' / 'step-4'}\n" in capsys.readouterr().out


def test_decode_shapes_left_out_of_the_precompile_are_noted_when_an_env_decodes(tmp_path):
    shapes_by_hand = ["--server.precompile_prompt_lens=[8]", "--server.precompile_decode=false"]
    config = load_config(QUICKSTART, [f"--run_dir={tmp_path / 'run'}", "--envs.addition.sampling.max_tokens=4", *shapes_by_hand])
    notes = check_run(config, resume=False).notes
    assert [n for n in notes if n.startswith("server.precompile_decode is off but addition asks for more than one token")]


def test_prompts_in_flight_count_a_request_per_group_or_per_rollout_and_none_with_evaluation(tmp_path):
    def in_flight(*overrides, config=QUICKSTART):
        config = load_config(config, [f"--run_dir={tmp_path / 'run'}", *overrides])
        checked = check_run(config, resume=False)
        return config, prompts_in_flight(config, checked.envs, checked.prompts)

    config, count = in_flight()  # one turn, sampled as `Env` does: one request of group_size samples per worker
    assert count == config.envs[0].replicas == 8
    assert in_flight("--envs.addition.replicas=3")[1] == 3
    config, count = in_flight(config="configs/multiturn.yaml")  # later turns: a request per rollout
    assert count == sum(e.replicas * e.group_size for e in config.envs) > sum(e.replicas for e in config.envs)
    assert in_flight("--eval_every=10")[1] is None  # evaluation sends every held-out problem at once


def test_on_a_cpu_a_prefill_call_takes_at_most_four_prompts_and_a_value_set_by_hand_is_kept(tmp_path):
    """The quickstart's 8 workers: a GPU's engine takes all 8 in one call, a CPU's at most 4 (one shape less to
    compile at start); `server.max_prefill_rows` set by hand wins."""
    from marin_rl.orchestrator._setup import embedded_server_config

    def rows(*overrides, backend="cpu"):
        config = load_config(QUICKSTART, [f"--run_dir={tmp_path / 'run'}", *overrides])
        checked = check_run(config, resume=False)
        return prefill_rows(config, checked.envs, checked.prompts, backend), embedded_server_config(config, checked).max_prefill_rows

    assert rows() == (CPU_PREFILL_ROWS, CPU_PREFILL_ROWS) == (4, 4)  # this CPU: the engine gets the cap
    assert rows(backend="gpu")[0] == 8
    assert rows("--envs.addition.replicas=3")[0] == 3
    assert rows("--eval_every=10")[0] == CPU_PREFILL_ROWS and rows("--eval_every=10", backend="gpu")[0] is None
    assert rows("--server.max_prefill_rows=8")[1] == 8


def test_engine_shapes_cover_the_envs_prompts_turns_decoding_and_top_p(tmp_path):
    def shapes(*overrides, config=QUICKSTART):
        config = load_config(config, [f"--run_dir={tmp_path / 'run'}", *overrides])
        return engine_shapes(check_run(config, resume=False).prompts, config.server.max_seq_len)

    # The quickstart: 7-token prompts, one-token answers: up to twice the longest prompt, no decode.
    assert shapes() == {"max_prefill_rows": None, "precompile_prompt_lens": (7, 14), "precompile_decode": False, "precompile_truncated": False}
    decoding = shapes("--envs.addition.sampling.max_tokens=4", "--envs.addition.sampling.top_p=0.9")
    assert decoding["precompile_decode"] and decoding["precompile_truncated"]
    # A later turn's prompt holds the conversation so far: every length up to the row.
    multi_turn = shapes(config="configs/multiturn.yaml")["precompile_prompt_lens"]
    assert multi_turn[-1] == 63 and {bucket(n, MIN_PREFILL_TIME) for n in multi_turn} == {16, 32, 64}
