import json

from marin_rl.plot import ENV_PANELS, FIGURES, collect, plot_run


def records():
    out = [{"step": 0, "eval/add/greedy/reward/mean": 0.1}]
    for step in range(1, 21):
        out.append(
            {
                "step": step,
                "learner/loss": 0.5,
                "learner/pg_loss": 0.5,
                "learner/ce_loss": 0.0,
                "learner/kl_loss": 0.0,
                "learner/entropy": 2.0,
                "learner/tokens_per_s": 10_000.0,
                "throughput/generated_tokens_per_s": 500.0,
                "replays/add/reward/mean": step / 20,
                "replays/add/rewards/correct/mean": step / 20,
                "replays/add/sampled_entropy": 3.0 - step / 10,
                "replays/mul/reward/mean": 0.0,
                **({"eval/add/greedy/reward/mean": step / 20} if step % 5 == 0 else {}),
            }
        )
    return out


def panel(figure, title):
    return next(p for p in FIGURES[figure][1] if p.title == title)


def test_each_quantity_gets_its_own_panel_and_unused_loss_parts_none():
    loss = [collect(records(), p) for p in FIGURES["loss"][1]]
    assert [list(series) for series in loss] == [["loss"], ["pg_loss"], [], []]  # ce and kl are all zero
    learner, generated = (collect(records(), p) for p in FIGURES["throughput"][1])
    assert list(learner) == ["learner"] and list(generated) == ["generated"]
    per_env = collect(records(), panel("entropy", "-log p of sampled tokens, per env"))
    assert per_env["add"][1][0] == 2.9 and "mul" not in per_env


def test_eval_is_a_series_over_time_and_env_figures_hold_their_own_metrics():
    (eval_panel,) = FIGURES["eval"][1]
    steps, values = collect(records(), eval_panel)["add greedy reward/mean"]
    assert steps == [0, 5, 10, 15, 20] and values[-1] == 1.0
    reward = collect(records(), ENV_PANELS[0], env="add")
    assert set(reward) == {"reward", "correct"} and len(reward["reward"][0]) == 20


def test_plot_run_writes_a_figure_per_topic_and_per_env(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records()) + "\n")
    names = sorted(p.name for p in plot_run(tmp_path))
    assert names == sorted(
        ["reward.png", "loss.png", "entropy.png", "throughput.png", "eval.png", "env_add.png", "env_mul.png"]
    )
    assert all((tmp_path / "plots" / name).stat().st_size > 10_000 for name in names)
