import re
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
