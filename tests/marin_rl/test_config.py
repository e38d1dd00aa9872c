import socket
from pathlib import Path

import pytest

from marin_rl.cli import main
from marin_rl.config import TrainConfig, dump_config, load_config
from marin_rl.errors import ConfigError

QUICKSTART = "configs/quickstart.yaml"


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_quickstart_config_parses_with_overrides():
    config = load_config(QUICKSTART, ["--run_dir=/tmp/elsewhere", "--max_steps", "7", "--learner.optimizer.learning_rate=1e-5"])
    assert isinstance(config, TrainConfig)
    assert config.run_dir == "/tmp/elsewhere" and config.max_steps == 7
    assert config.learner.optimizer.learning_rate == 1e-5
    assert config.envs[0].type == "toy_addition" and config.envs[0].sampling.max_tokens == 1
    # The resolved dump reads back to the same config.
    assert load_config(_dump(config)) == config


def _dump(config):
    import tempfile

    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    f.write(dump_config(config))
    f.close()
    return f.name


@pytest.mark.parametrize(("value", "setting"), [("off", "off"), ("false", "off"), ("auto", "auto"), ("true", "auto"), ("/tmp/jax", "/tmp/jax")])
def test_compilation_cache_reads_yamls_off_and_on(tmp_path, value, setting):
    (tmp_path / "c.yaml").write_text(Path(QUICKSTART).read_text() + f"\ncompilation_cache: {value}\n")
    assert load_config(tmp_path / "c.yaml").compilation_cache == setting
    assert load_config(QUICKSTART, [f"--compilation_cache={value}"]).compilation_cache == setting


def test_unknown_key_names_the_key_and_the_allowed_ones(tmp_path):
    path = write(tmp_path, "envs: [{name: a, type: toy_addition}]\nlearner: {optimizer: {lr: 1.0e-3}}\n")
    with pytest.raises(ConfigError, match=r"learner.optimizer.lr: unknown key \(did you mean 'learning_rate'\?\); allowed: \['learning_rate'"):
        load_config(path)


def test_a_misspelt_override_names_the_key_and_the_command_line():
    with pytest.raises(ConfigError, match=r"^command line: max_step: unknown key \(did you mean 'max_steps'\?\)"):
        load_config(QUICKSTART, ["--max_step", "5"])
    with pytest.raises(ConfigError, match=r"^command line: envs.0.sampling.max_token: unknown key \(did you mean 'max_tokens'"):
        load_config(QUICKSTART, ["--envs.addition.sampling.max_token=4"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("learner: {optimizer: {learning_rate: fast}}", "learner.optimizer.learning_rate: 'fast' is not a number"),
        ("max_steps: 1.5", "max_steps: 1.5 is not an integer"),
        ("eval_every: soon", "eval_every: 'soon' is not an integer or null"),
        ("batcher: {overlong: drop}", r"batcher.overlong: 'drop' is not one of \['reject', 'truncate'\]"),
        ("learner: [1]", r"learner: \[1\] is not a section"),
        ("envs: {name: a}", "envs: {'name': 'a'} is not a list of sections"),
        ("envs: [{name: a}]", r"envs.0.type: is required"),
    ],
)
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(tmp_path, text, message):
    if not text.startswith("envs"):
        text = "envs: [{name: a, type: toy_addition}]\n" + text
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--run_dir.x=1"], "command line: --run_dir.x: run_dir is not a section"),
        (["--broadcaster.remote_servers=[]", "--broadcaster.remote_servers.0=x"], "remote_servers has 0 items, no item '0'"),
        (["--broadcaster.remote_servers.a=1"], r"command line: broadcaster.remote_servers: {'a': 1} is not a list"),
        (["--max_steps"], "--max_steps needs a value"),
        (["max_steps=3"], "'max_steps=3' is not an override"),
    ],
)
def test_malformed_overrides_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(QUICKSTART, overrides)


def test_lenient_scalars_become_exact():
    config = load_config(QUICKSTART, ["--run_dir", "2024", "--learner.optimizer.learning_rate", "1e-5"])
    assert config.run_dir == "2024" and config.learner.optimizer.learning_rate == 1e-5


def test_bad_choice_names_the_key_and_the_allowed_values(tmp_path):
    path = write(tmp_path, "envs: [{name: a, type: toy_addition, algorithm: {type: ppo}}]\n")
    # (Other tests register algorithms of their own: the built-in ones are named, in order.)
    with pytest.raises(ConfigError, match=r"envs.0.algorithm.type: 'ppo' is not one of \['dr_grpo', 'grpo', .*'opd', 'rloo', 'sft'\]"):
        load_config(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("envs: []\n", "at least one env"),
        ("envs: [{name: a, type: t, fraction: 0.7}, {name: b, type: t, fraction: 0.7}]\n", "sum to <= 1"),
        ("envs: [{name: a, type: t}, {name: a, type: t}]\n", "unique"),
        ("envs: [{name: a, type: t, group_size: 1}]\n", "min_group_size"),
        ("envs: [{name: a, type: t}]\nbatcher: {max_seq_len: 4096, total_token_budget: 8192}\nmodel: {seq_len: 1024}\n", "model.seq_len"),
        ("envs: [{name: a, type: t}]\nmodel: {family: gpt}\n", "family"),
        ("envs: [{name: a, type: t, group_size: 1, buffer: {min_group_size: 1}}]\n", "group_size must be >= 2"),
        ("envs: [{name: a, type: t, algorithm: {type: opd}}]\n", "needs teacher_server"),
        ("envs: [{name: a, type: t, sampling: {temperature: 0.7}}]\n", "temperature"),
    ],
)
def test_inconsistent_configs_are_rejected_with_the_reason(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    path = write(tmp_path, "envs: [{name: a, type: toy_addition}]\nmax_stepz: 3\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_stepz: unknown key (did you mean 'max_steps'?)" in err


def test_train_help_lists_every_config_key_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["train", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for line in ("learner.optimizer.learning_rate = 1e-06", "envs[].group_size = 8", "envs[].algorithm.type = rloo", "batcher.max_seq_len = 1024"):
        assert f"  {line}\n" in out
    assert "Peak learning rate." in out


def test_env_overrides_address_an_env_by_name_or_index():
    config = load_config(
        QUICKSTART, ["--envs.addition.group_size=16", "--envs.0.sampling.max_tokens", "3", "--envs.addition.args.addends=[1, 2]"]
    )
    (env,) = config.envs
    assert env.group_size == 16 and env.sampling.max_tokens == 3 and env.args["addends"] == [1, 2]
    with pytest.raises(ConfigError, match=r"--envs.nope.group_size: no env named 'nope'; envs: \['addition'\]"):
        load_config(QUICKSTART, ["--envs.nope.group_size=16"])


def test_serve_command_reads_its_config_from_flags(monkeypatch):
    seen = {}
    monkeypatch.setattr("marin_rl.server.serve_main", lambda config: seen.setdefault("config", config))
    assert main(["serve", "--checkpoint", "/ckpt", "--tokenizer", "char", "--server.port", "8011"]) == 0
    assert seen["config"].checkpoint == "/ckpt" and seen["config"].server.port == 8011
    assert seen["config"].server.host == "127.0.0.1"


def test_serve_refuses_a_checkpoint_that_is_not_a_local_dir_in_one_line(tmp_path, capsys):
    # transformers would take the path for a hub name and try to download it.
    assert main(["serve", "--checkpoint", str(tmp_path / "typo/dir"), "--tokenizer", "char"]) == 1
    err = capsys.readouterr().err
    assert "typo/dir" in err and "not a local Hugging Face checkpoint" in err and "Traceback" not in err


def test_serve_on_a_port_in_use_is_one_line_exit_2_before_the_model_loads(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text("{}")  # never read: the port is checked first
    monkeypatch.setattr("marin_rl.server._process.load_checkpoint", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--checkpoint", str(tmp_path), "--tokenizer", "char", "--server.port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"error: server.port {port} on 127.0.0.1 is in use (another server?): choose another port, or 0 for a free one" in err


def test_the_written_config_holds_no_weight_update_token():
    config = load_config(
        QUICKSTART, ["--broadcaster.weight_update_token=s3cret", "--server.weight_update_token=s3cret", "--learner.optimizer.learning_rate=1e-5"]
    )
    text = dump_config(config)
    assert "s3cret" not in text and "learning_rate: 1.0e-05" in text
    assert load_config(_dump(config)).broadcaster.weight_update_token is None  # read from the environment again


def test_a_negative_learning_rate_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="learning_rate must be >= 0"):
        load_config(QUICKSTART, ["--learner.optimizer.learning_rate=-1e-3"])


def test_rollouts_per_row_are_uncapped_unless_the_config_caps_them():
    # cuDNN attention does not cap them: short rollouts would leave rows mostly padding.
    assert load_config(QUICKSTART, ["--model.attn_backend=cudnn"]).batcher.max_rollouts_per_row is None
    chosen = load_config(QUICKSTART, ["--model.attn_backend=cudnn", "--batcher.max_rollouts_per_row=15"])
    assert chosen.batcher.max_rollouts_per_row == 15
    assert load_config(_dump(chosen)) == chosen
    with pytest.raises(ConfigError, match="max_rollouts_per_row"):
        load_config(QUICKSTART, ["--batcher.max_rollouts_per_row=0"])
