import json
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).parents[2] / "docs" / "envs.md"


def test_envs_doc_examples_run():
    """Every ```python block of docs/envs.md runs, in order, in one namespace (```py blocks need a server)."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) >= 6
    namespace: dict = {"__name__": "envs_doc"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name}[python block {i}]", "exec"), namespace)
    assert namespace["rollout"].metadata["reward_errors"]["broken"] == "RuntimeError: judge unavailable"


CHECK = """
import json
from marin_rl.config import load_config
from marin_rl.orchestrator._preflight import check_run

checked = check_run(load_config("my_run.yaml"), resume=False)
lengths = checked.prompts["reverse"]
print(json.dumps({"notes": checked.notes, "prompts": [lengths.shortest, lengths.longest]}))
"""


def test_the_run_recipe_of_section_7_passes_the_checks(tmp_path):
    """Section 7's env file and config, as a user saves them, pass every check before a run (no note)."""
    text = DOC.read_text()
    env_code = re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)[0]
    section = text[text.index("## 7. Run it") :]
    config = re.findall(r"^```yaml\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)[0]
    (tmp_path / "my_env.py").write_text(env_code)
    (tmp_path / "my_run.yaml").write_text(config)
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["notes"] == []
    shortest, longest = result["prompts"]
    assert f"prompts {shortest}-{longest} tokens, max_tokens 32, group 8" in section
