import pytest

from marin_rl.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("char")


@pytest.fixture(scope="session")
def render_ids(tokenizer):
    """The chat template's rendering of a list of (role, content) pairs."""

    def render(pairs, add_generation_prompt=False):
        messages = [{"role": role, "content": content} for role, content in pairs]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    return render
