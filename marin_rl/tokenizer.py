"""Tokenizers: loading by name or path, and the character-level tokenizer shipped for the quickstart.

Nothing can come from a model hub here, so the quickstart and the tests use a character-level
tokenizer saved in the repo (`marin_rl/assets/char_tokenizer/`, a normal Hugging Face tokenizer
directory). Its chat template renders each message as `<|role|>content<|end|>`, which is prefix
stable: rendering a longer conversation only appends tokens.
"""

from __future__ import annotations

import string
from pathlib import Path

CHAR_TOKENIZER_DIR = Path(__file__).parent / "assets" / "char_tokenizer"
CHAR_TOKENIZER = "char"
"""Config name for the shipped character tokenizer."""

SPECIAL_TOKENS = ("<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
END_OF_TURN = "<|end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MODEL_MAX_LENGTH = 4096


def load_tokenizer(name_or_path: str):
    """A Hugging Face tokenizer from a local directory, or the shipped one for `char`."""
    from transformers import AutoTokenizer

    path = CHAR_TOKENIZER_DIR if name_or_path == CHAR_TOKENIZER else Path(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer: {name_or_path!r} is not a local tokenizer directory (no hub access here); "
            f"use {CHAR_TOKENIZER!r} for the shipped character tokenizer"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.model_max_length is None or tokenizer.model_max_length > 1_000_000:
        # Levanter's engine sizes its prefill buffer from it; HF uses a huge sentinel when unset.
        tokenizer.model_max_length = MODEL_MAX_LENGTH
    return tokenizer


def build_char_tokenizer():
    """Build the character-level tokenizer saved in `CHAR_TOKENIZER_DIR` (kept in sync by a test)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    # BPE with no merges splits text into single characters; the special tokens match whole.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token=END_OF_TURN,
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
