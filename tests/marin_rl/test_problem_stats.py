from marin_rl.problem_stats import problem_stats


def columns(rows):
    """rows: (env, problem, group, version, reward) -> the viewer's index columns."""
    names = ("environment", "problem_id", "group_id", "policy_version", "reward")
    out = {name: [row[k] for row in rows] for k, name in enumerate(names)}
    out["rollout_uid"] = [f"u{i}" for i in range(len(rows))]
    return out


def test_failing_problems_come_first_with_when_they_were_solved_and_their_signal():
    rows = []
    for version in range(30):
        for problem, rewards in (("easy", [1.0, 1.0]), ("stuck", [0.0, 0.0]), ("learning", [0.0, 1.0] if version < 25 else [1.0, 1.0])):
            rows += [("math", problem, f"{problem}-{version}", version, r) for r in rewards]
    rows += [("code", "other", "o-0", 3, 0.5)]  # another env: its own recent window (its latest version is 3)
    stats = problem_stats(columns(rows))
    assert [(s.env, s.problem_id) for s in stats] == [("math", "stuck"), ("code", "other"), ("math", "learning"), ("math", "easy")]
    stuck, other, learning, easy = stats
    assert stuck.recent_reward == 0.0 and stuck.first_solved is None and stuck.zero_variance == 1.0 and stuck.rollouts == 60
    assert stuck.recent_rollouts == 20 and stuck.latest_group == "stuck-29"
    assert other.recent_reward == 0.5 and other.first_solved is None
    # versions 20-29: 5 groups of (0, 1), then 5 of (1, 1)
    assert learning.recent_reward == 0.75 and learning.first_solved == 0 and learning.zero_variance == 0.5
    assert easy.recent_reward == 1.0 and easy.zero_variance == 1.0
    assert problem_stats(columns(rows), solved=2.0)[-1].first_solved is None
