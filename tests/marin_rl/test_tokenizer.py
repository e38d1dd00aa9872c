import json

from marin_rl.tokenizer import CHAR_TOKENIZER_DIR, build_char_tokenizer, load_tokenizer


def test_shipped_char_tokenizer_matches_builder(tmp_path):
    build_char_tokenizer().save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / name).read_text() == (CHAR_TOKENIZER_DIR / name).read_text(), name
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == json.loads(
        (CHAR_TOKENIZER_DIR / "tokenizer_config.json").read_text()
    )


def test_char_tokenizer_round_trips_text_and_is_prefix_stable():
    tokenizer = load_tokenizer("char")
    text = "What is 3+4? <answer>7</answer>\n"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "7"}, {"role": "tool", "content": "x"}]
    previous: list[int] = []
    for k in range(1, len(messages) + 1):
        ids = tokenizer.apply_chat_template(messages[:k])
        assert ids[: len(previous)] == previous
        previous = ids
    assert tokenizer.eos_token == "<|end|>"
