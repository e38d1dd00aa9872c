import copy

import numpy as np
import pytest

from marin_rl.envs import ChatTemplateError, Completion, Transcript
from marin_rl.types import InferenceMetadata


def _completion(ids, finish="stop"):
    meta = InferenceMetadata(server_id="s", model="m", policy_version=0, finish_reason=finish)
    return Completion(ids, np.full(len(ids), -0.5), meta)


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_prompt_turns_concatenate_to_the_template_rendering(tokenizer, render_ids):
    pairs = [("system", "Be brief."), ("user", "What is 3+4?")]
    transcript = Transcript(tokenizer, [{"role": r, "content": c} for r, c in pairs])
    assert transcript.token_ids == render_ids(pairs, add_generation_prompt=True)
    system, user = transcript.turns()
    assert system.token_ids.tolist() == render_ids(pairs[:1])
    # The generation prompt is prompt: it belongs to the turn before the assistant's.
    assert tokenizer.decode(user.token_ids) == "<|user|>What is 3+4?<|end|><|assistant|>"


def test_multi_turn_ids_equal_the_rendering_of_the_whole_conversation(tokenizer, render_ids):
    transcript = Transcript(tokenizer, [{"role": "user", "content": "add 2 and 3"}])
    eos = tokenizer.eos_token_id
    first = [*_encode(tokenizer, "<calc>2+3</calc>"), eos]
    assert transcript.add_completion(_completion(first)) == "<calc>2+3</calc>"
    transcript.add_messages([{"role": "tool", "content": "5"}])
    transcript.add_completion(_completion([*_encode(tokenizer, "<answer>5</answer>"), eos]))
    pairs = [(m["role"], m["content"]) for m in transcript.messages]
    assert pairs == [("user", "add 2 and 3"), ("assistant", "<calc>2+3</calc>"), ("tool", "5"), ("assistant", "<answer>5</answer>")]
    assert transcript.token_ids == render_ids(pairs)
    turns = transcript.turns()
    assert [t.role for t in turns] == ["user", "assistant", "tool", "assistant"]
    assert turns[1].token_ids.tolist() == first  # the sampled ids, untouched
    assert turns[1].inference_metadata is not None and turns[0].inference_metadata is None


def test_closing_scaffold_the_model_did_not_sample_goes_to_the_next_turn(tokenizer, render_ids):
    # Stopped at a stop string (or max_tokens): no EOS sampled, the template still closes the turn.
    transcript = Transcript(tokenizer, [{"role": "user", "content": "q"}])
    sampled = _encode(tokenizer, "<calc>1</calc>")
    transcript.add_completion(_completion(sampled))
    transcript.add_messages([{"role": "tool", "content": "1"}])
    assert transcript.token_ids == render_ids(
        [("user", "q"), ("assistant", "<calc>1</calc>"), ("tool", "1")], add_generation_prompt=True
    )
    tool = transcript.turns()[2]
    assert tokenizer.decode(tool.token_ids) == "<|end|><|tool|>1<|end|><|assistant|>"
    assert transcript.turns()[1].token_ids.tolist() == sampled


def test_sampled_ids_that_are_not_the_canonical_encoding_are_kept(tokenizer):
    transcript = Transcript(tokenizer, [{"role": "user", "content": "q"}])
    eos = tokenizer.eos_token_id
    odd = [*_encode(tokenizer, "ab"), eos, *_encode(tokenizer, "c")]  # decodes to "abc"
    transcript.add_completion(_completion(odd))
    before = len(transcript.token_ids)
    transcript.add_messages([{"role": "user", "content": "more"}])
    ids = transcript.token_ids
    assert ids[before - len(odd) : before] == odd
    assert tokenizer.decode(ids[before:]) == "<|end|><|user|>more<|end|><|assistant|>"


def test_template_that_trims_content_keeps_the_untrimmed_sampled_ids(tokenizer):
    trimming = copy.deepcopy(tokenizer)
    # Like Llama 3's template: `message['content'] | trim`.
    trimming.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    transcript = Transcript(trimming, [{"role": "user", "content": "q"}])
    sampled = [*_encode(tokenizer, " 42\n"), tokenizer.eos_token_id]
    transcript.add_completion(_completion(sampled))
    start = len(transcript.token_ids)
    transcript.add_messages([{"role": "user", "content": "and?"}])
    ids = transcript.token_ids
    assert ids[start - len(sampled) : start] == sampled
    assert tokenizer.decode(ids[start:]) == "<|user|>and?<|end|><|assistant|>"


def test_message_spans_cover_each_message_without_generation_prompts(tokenizer):
    transcript = Transcript(tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    ids = transcript.token_ids
    spans = transcript.message_spans()
    assert [tokenizer.decode(ids[a:b]) for a, b in spans] == ["<|system|>s<|end|>", "<|user|>u<|end|>"]


def test_non_prefix_stable_template_names_the_tokenizer(tokenizer):
    unstable = copy.deepcopy(tokenizer)
    unstable.name_or_path = "unstable-tok"
    # Counting messages up front changes earlier tokens as the conversation grows.
    unstable.chat_template = (
        "{{ messages|length }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    # The prompt is rendered as one block (its ids are exact); growing the conversation is what fails.
    transcript = Transcript(unstable, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    transcript.add_completion(_completion([*_encode(tokenizer, "a"), tokenizer.eos_token_id]))
    with pytest.raises(ChatTemplateError, match="unstable-tok"):
        transcript.add_messages([{"role": "user", "content": "again"}])


def test_template_that_rewrites_earlier_assistant_turns_is_refused(tokenizer):
    thinking = copy.deepcopy(tokenizer)
    thinking.name_or_path = "thinks-tok"
    # Like templates that wrap a past assistant turn in an (empty) reasoning block.
    thinking.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}[]{% endif %}"
        "{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    transcript = Transcript(thinking, [{"role": "user", "content": "q"}])
    transcript.add_completion(_completion([*_encode(tokenizer, "a"), tokenizer.eos_token_id]))
    with pytest.raises(ChatTemplateError, match="thinks-tok"):
        transcript.add_messages([{"role": "user", "content": "again"}])


def test_prompts_and_new_messages_are_checked(tokenizer):
    with pytest.raises(ValueError, match="role"):
        Transcript(tokenizer, [{"role": "assistant", "content": "few-shot"}])
    with pytest.raises(ValueError, match="content must be a string"):
        Transcript(tokenizer, [{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    transcript = Transcript(tokenizer, [{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match="follows an assistant turn"):
        transcript.add_messages([{"role": "user", "content": "x"}])


def test_copies_grow_independently(tokenizer):
    base = Transcript(tokenizer, [{"role": "user", "content": "q"}])
    a, b = base.copy(), base.copy()
    a.add_completion(_completion(_encode(tokenizer, "x")))
    a.add_messages([{"role": "user", "content": "y"}])
    assert b.token_ids == base.token_ids and b.num_assistant_turns == 0


TOOLS = [{"type": "function", "function": {"name": "calc_add", "description": "Add.", "parameters": {"type": "object"}}}]


def test_tools_are_rendered_by_the_template_and_parallel_results_share_its_block(qwen_tokenizer):
    prompt = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2+3?"}]
    transcript = Transcript(qwen_tokenizer, prompt, tools=TOOLS)
    assert transcript.token_ids == qwen_tokenizer.apply_chat_template(prompt, tools=TOOLS, add_generation_prompt=True)
    calls = '<tool_call>\n{"name": "calc_add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    transcript.add_completion(_completion([*_encode(qwen_tokenizer, calls), qwen_tokenizer.eos_token_id]))
    transcript.add_messages([{"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}])
    messages = [*prompt, {"role": "assistant", "content": calls}, {"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}]
    assert transcript.token_ids == qwen_tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    # Qwen renders consecutive tool results as one user block: its ids go to the block's last message.
    first, second = transcript.turns()[3:]
    assert qwen_tokenizer.decode(first.token_ids) == "\n"  # what closes the assistant turn
    assert qwen_tokenizer.decode(second.token_ids).startswith("<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>")


def test_a_template_that_cannot_render_part_of_the_prompt_gives_it_to_the_next_message(llama3_tokenizer):
    # Llama 3 with tools puts them into the first user message: a system message alone does not render.
    prompt = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2+3?"}]
    transcript = Transcript(llama3_tokenizer, prompt, tools=TOOLS)
    assert transcript.token_ids == llama3_tokenizer.apply_chat_template(prompt, tools=TOOLS, add_generation_prompt=True)
    system, user = transcript.turns()
    assert len(system.token_ids) == 0 and len(user.token_ids) == len(transcript.token_ids)
