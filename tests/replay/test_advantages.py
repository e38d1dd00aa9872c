import numpy as np
import pytest

from marin_rl.replay import dr_grpo_advantages, grpo_advantages, rloo_advantages


def test_rloo_matches_hand_computed_leave_one_out():
    # r = [1, 0, 0, 1]: each baseline is the mean of the other three.
    np.testing.assert_allclose(rloo_advantages([1, 0, 0, 1]), [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    np.testing.assert_allclose(rloo_advantages([3.0, 1.0]), [2.0, -2.0])


def test_grpo_normalises_by_sample_std():
    # mean 0.5, sample std sqrt(1/3)
    std = np.sqrt(((0.5**2) * 4) / 3)
    np.testing.assert_allclose(grpo_advantages([1, 0, 0, 1], eps=0.0), [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    np.testing.assert_allclose(grpo_advantages([2.0, 4.0], eps=0.0), [-1 / np.sqrt(2), 1 / np.sqrt(2)])


def test_dr_grpo_subtracts_mean_only():
    np.testing.assert_allclose(dr_grpo_advantages([2.0, 4.0, 9.0]), [-3.0, -1.0, 4.0])


@pytest.mark.parametrize("estimator", [rloo_advantages, grpo_advantages, dr_grpo_advantages])
def test_group_of_one_and_equal_rewards_give_zero(estimator):
    np.testing.assert_array_equal(estimator([0.7]), [0.0])
    np.testing.assert_allclose(estimator([0.5, 0.5, 0.5]), [0.0, 0.0, 0.0], atol=1e-12)


def test_estimators_agree_with_each_other_up_to_their_scaling():
    rewards = np.array([1.0, 0.0, 0.5, 0.25])
    n = len(rewards)
    np.testing.assert_allclose(rloo_advantages(rewards), n / (n - 1) * dr_grpo_advantages(rewards))
    np.testing.assert_allclose(grpo_advantages(rewards, eps=0.0), dr_grpo_advantages(rewards) / rewards.std(ddof=1))
