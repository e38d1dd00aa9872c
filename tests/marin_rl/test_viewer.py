import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from marin_rl import viewer
from marin_rl.replay import OpdConfig, RlooConfig, TeacherConfig, rloo_advantages
from marin_rl.storage import RolloutWriter
from marin_rl.testing import make_group
from marin_rl.tokenizer import load_tokenizer


@pytest.fixture
def run(tmp_path):
    writer = RolloutWriter(tmp_path / "rollouts" / "math")
    writer.append(make_group([1.0, 0.0, 0.0, 1.0], env="math", group_id="a", policy_version=0))
    writer.append(make_group([1.0, 1.0], env="math", group_id="b", policy_version=1))
    writer.close()
    return tmp_path


def test_the_index_gives_each_rollout_its_group_advantage(run):
    index = viewer.build_index(run, {"math": RlooConfig()})
    assert index.size == 6 and index.columns["policy_version"] == [0, 0, 0, 0, 1, 1]
    assert index.columns["advantage"][:4] == pytest.approx(rloo_advantages(np.array([1.0, 0.0, 0.0, 1.0])).tolist())
    assert index.columns["advantage"][4:] == [0.0, 0.0]
    assert viewer.build_index(run, {}).columns["advantage"] == [None] * 6  # no config: no advantages


def test_a_rollout_shows_its_tokens_logprobs_and_per_token_advantages(run):
    index = viewer.build_index(run, {"math": RlooConfig()})
    reader = viewer.RolloutReader(index, load_tokenizer("char"), {"math": RlooConfig()})
    shown = reader.rollout(index.columns["rollout_uid"][0])
    prompt, completion = shown["turns"]
    assert prompt["tokens"] is None and prompt["advantages"] is None
    assert len(completion["tokens"]) == len(completion["logprobs"]) == len(completion["advantages"]) == 3
    assert completion["advantages"] == [pytest.approx(index.columns["advantage"][0], abs=1e-5)] * 3
    # opd: the teacher's per-token signal (no teacher log-probs here: none to show)
    opd = viewer.RolloutReader(index, None, {"math": OpdConfig(teacher_server=TeacherConfig("http://x/v1"))})
    assert opd.rollout(index.columns["rollout_uid"][0])["turns"][1]["advantages"] is None


def test_the_server_answers_rollouts_and_search_on_127_0_0_1_only(run):
    index = viewer.build_index(run, {})
    server = viewer.make_server(index, viewer.RolloutReader(index, None, {}), port=0)
    assert server.server_address[0] == "127.0.0.1"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def get(path):
        with urllib.request.urlopen(base + path) as response:
            return response.read().decode()

    try:
        uid = index.columns["rollout_uid"][5]
        assert json.loads(get(f"/api/rollout/{uid}"))["uid"] == uid
        assert len(json.loads(get("/api/search?q=COMPLETION"))["uids"]) == 6
        page = get("/")
        assert '"on_disk":6' in page and "/*DATA*/" not in page
        for missing in ("/api/rollout/nope", "/etc/passwd"):
            with pytest.raises(urllib.error.HTTPError) as e:
                get(missing)
            e.value.close()
            assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_a_file_keeps_every_problems_latest_group_failing_first_and_a_sample_across_versions(tmp_path):
    writer = RolloutWriter(tmp_path / "rollouts" / "addition")
    for version in range(40):
        for a in range(5):
            rewards = [0.0] * 4 if a == 3 else [1.0, 0.0, 1.0, 1.0]
            writer.append(make_group(rewards, env="addition", group_id=f"g{version}-{a}", problem_id=f"{a}+1=", policy_version=version, seed=a))
    writer.close()
    index = viewer.build_index(tmp_path, {})
    problems = viewer.problem_stats(index.columns)
    assert problems[0].problem_id == "3+1="
    rows, kept = viewer.select_for_file(index, 100, problems)
    assert len(rows) == len(set(rows)) == 100
    chosen = {index.columns["group_id"][i] for i in rows}
    assert {f"g39-{a}" for a in range(5)} <= chosen  # every problem's latest group, the failing one included
    versions = {index.columns["policy_version"][i] for i in rows}
    assert min(versions) == 0 and len(versions) >= 15  # a group from versions across the run, not only the newest
    assert kept.startswith("100 of 800 rollouts: the latest group of each of 5 problems (20, 5 problems below a recent reward of 1")
    # Room for the failing problem's latest group only: it goes first.
    rows, _ = viewer.select_for_file(index, 4, problems)
    assert {index.columns["group_id"][i] for i in rows} == {"g39-3"}
