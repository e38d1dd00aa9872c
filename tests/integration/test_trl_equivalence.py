"""Our GRPO steps are TRL's `GRPOTrainer` steps: from one Hugging Face checkpoint and the same rollouts
(prompts, completions, rewards), each of two steps has the same loss, the same gradient of every
parameter (after clipping), and ends with the same weights. TRL's settings are its defaults (`dapo`
loss, `group` reward scaling, AdamW) with no KL, a constant learning rate and float32; ours are what
docs/algorithms.md says reproduces them. This rules out a bug in advantages, loss aggregation,
clipping or the optimizer as the cause of a gap in learning per step (issue 28).

TRL samples nothing here: its `rollout_func` hands it the same completions our side trains on, and a
reward function reads their rewards from the same table.
"""

import collections
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
import trl

from marin_rl.learner import Learner, LearnerConfig, ModelConfig, OptimizerConfig, loss_and_gradients, save_hf_model
from marin_rl.replay import Batcher, BatcherConfig, GrpoConfig, ReplayBuffer, ReplayBufferConfig
from marin_rl.tokenizer import CHAR_TOKENIZER_DIR, load_tokenizer
from marin_rl.types import InferenceMetadata, Rollout, Turn

PROBLEMS = [0, 1, 2, 3]
GROUP = 4
STEPS = 2
LR = 1e-3
MAX_COMPLETION = 6


def rollout_table(tokenizer):
    """For each step, problem and member: (completion ids, reward). Lengths 1-6, some ending in EOS (the
    others truncated), rewards 0/1 with one group of equal rewards (advantage 0) per step."""
    rng = np.random.default_rng(0)
    chars = tokenizer.convert_tokens_to_ids(list("0123456789+= abcxyz"))
    table, drawn = {}, set()
    for step, problem in itertools.product(range(STEPS), PROBLEMS):
        rewards = [1.0] * GROUP if problem == step else list(rng.permutation([1.0, 0.0, 0.0, 1.0 if problem % 2 else 0.0]))
        for member in range(GROUP):
            ids = None
            while ids is None or tuple(ids) in drawn:  # distinct, so TRL's reward function can look them up
                ids = [int(i) for i in rng.choice(chars, rng.integers(1, MAX_COMPLETION + 1))]
                if member % 2 == 0:
                    ids[-1] = tokenizer.eos_token_id
            drawn.add(tuple(ids))
            table[step, problem, member] = (ids, rewards[member])
    return table


def prompt_ids(tokenizer, problem: int) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": f"{problem}+1="}], add_generation_prompt=True)


def torch_logprobs(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    """The model's log-prob of each completion token (the behaviour log-probs of an on-policy sample)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].numpy()


def run_trl(checkpoint, table, tokenizer):
    """TRL's two steps: each step's logged loss and grad_norm, clipped gradients (by parameter name), and
    the state dict after it."""
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    data = trl_dataset()
    calls = itertools.count()

    def rollout(prompts, trainer):
        step, seen = next(calls), collections.Counter()
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
        for prompt in prompts:
            problem = int(prompt[-1]["content"][0])
            out["prompt_ids"].append(prompt_ids(tokenizer, problem))
            out["completion_ids"].append(table[step, problem, seen[problem]][0])
            seen[problem] += 1
        return out

    reward_of = {tuple(ids): r for ids, r in table.values()}

    def reward(completion_ids, **_):
        return [reward_of[tuple(ids)] for ids in completion_ids]

    logs, gradients, states = [], [], []

    class Record(transformers.TrainerCallback):
        def on_log(self, _args, _state, _control, logs_=None, **kwargs):
            record = kwargs.get("logs", logs_)
            if record and "grad_norm" in record:
                logs.append({"loss": float(record["loss"]), "grad_norm": float(record["grad_norm"])})

        def on_pre_optimizer_step(self, _args, _state, _control, model=None, **_):
            gradients.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})

        def on_step_end(self, _args, _state, _control, model=None, **_):
            states.append({name: p.detach().clone() for name, p in model.state_dict().items()})

    config = trl.GRPOConfig(
        output_dir=str(checkpoint.parent / "trl"),
        learning_rate=LR,
        lr_scheduler_type="constant",
        per_device_train_batch_size=len(PROBLEMS) * GROUP,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        beta=0.0,
        max_steps=STEPS,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,  # TRL's default autocasts to bfloat16, on the CPU too; both sides compute in float32 here
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=hf_tokenizer(), rollout_func=rollout, callbacks=[Record()]
    )
    trainer.train()
    return logs, gradients, states


def hf_tokenizer():
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(CHAR_TOKENIZER_DIR))
    tokenizer.model_input_names = ["input_ids", "attention_mask"]  # Llama takes no token_type_ids
    return tokenizer


def trl_dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{a}+1="}] for a in PROBLEMS]})


def our_example(step, table, tokenizer, behaviour_model):
    """Step `step`'s rollouts through a GRPO replay buffer and the batcher, as a run packs them; the
    behaviour log-probs are `behaviour_model`'s (the policy that sampled them, as on-policy)."""
    buffer = ReplayBuffer("addition", ReplayBufferConfig(), algorithm=GrpoConfig(eps=1e-4))
    for problem in PROBLEMS:
        prompt = prompt_ids(tokenizer, problem)
        group = []
        for member in range(GROUP):
            ids, reward = table[step, problem, member]
            ended = ids[-1] == tokenizer.eos_token_id
            metadata = InferenceMetadata(server_id="s", model="m", policy_version=step, finish_reason="stop" if ended else "length")
            completion = Turn(
                "assistant", "", np.array(ids, np.int32), logprobs=torch_logprobs(behaviour_model, prompt, ids), inference_metadata=metadata
            )
            turns = (Turn("user", f"{problem}+1=", np.array(prompt, np.int32)), completion)
            group.append(
                Rollout(
                    environment="addition", problem_id=str(problem), rollout_uid=f"{step}-{problem}-{member}", group_id=f"{step}-{problem}",
                    turns=turns, rewards={"correct": reward}, reward=reward, is_truncated=not ended,
                )  # fmt: skip
            )
        buffer.add(group)
    batcher = Batcher({"addition": buffer}, {"addition": 1.0}, BatcherConfig(total_token_budget=8 * 64, max_seq_len=64, max_wait_s=0.0))
    batch = batcher.next_batch(policy_version=step)
    assert sum(len(g.members) for g in batch.groups) == len(PROBLEMS) * GROUP
    return batch.to_example()


def clipped_gradients_by_hf_name(learner, example, tokenizer, directory) -> dict:
    """Our gradients of `example` at the learner's weights, clipped as its optimizer clips them, under
    transformers' parameter names (written through the HF export, which maps the names and layouts)."""
    _, gradients, _, _ = loss_and_gradients(learner.model, example, config=learner.config, compute_dtype=jnp.float32)
    norm = float(optax.tree.norm(gradients))
    clip = learner.config.optimizer.max_grad_norm
    scale = 1.0 if clip is None else min(1.0, clip / norm)
    as_model = eqx.combine(jax.tree.map(lambda g: g * scale, gradients), eqx.filter(learner.model, eqx.is_inexact_array, inverse=True))
    path = save_hf_model(as_model, tokenizer, directory, dtype=jnp.float32)
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_two_grpo_steps_end_with_trls_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # `rollout_func` is marked experimental
    tokenizer = load_tokenizer("char")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    checkpoint = tmp_path / "init"
    transformers.LlamaForCausalLM(config).save_pretrained(checkpoint)
    table = rollout_table(tokenizer)

    trl_logs, trl_gradients, trl_states = run_trl(checkpoint, table, tokenizer)
    assert len(trl_logs) == len(trl_gradients) == len(trl_states) == STEPS

    learner = Learner(
        LearnerConfig(optimizer=OptimizerConfig(learning_rate=LR, max_grad_norm=1.0), export_dtype="float32"),
        ModelConfig(hf_checkpoint=str(checkpoint), compute_dtype="float32", seq_len=64),
        tmp_path / "ours",
        tokenizer,
        key=jax.random.key(0),
    )
    behaviour = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    initial = {name: p.detach().clone() for name, p in behaviour.state_dict().items()}
    for step in range(STEPS):
        example = our_example(step, table, tokenizer, behaviour)
        gradients = clipped_gradients_by_hf_name(learner, example, tokenizer, tmp_path / f"gradients-{step}")
        for name, theirs in trl_gradients[step].items():
            error = ((gradients[name] - theirs).norm() / theirs.norm()).item()
            assert error < 1e-5, f"step {step + 1}: the gradient of {name} differs from TRL's by {error:.1e} (relative)"
        metrics = learner.step(example)
        # transformers logs the loss rounded to 4 decimals
        assert metrics["loss"] == pytest.approx(trl_logs[step]["loss"], abs=5e-5), f"step {step + 1}: loss"
        assert metrics["grad_norm"] == pytest.approx(trl_logs[step]["grad_norm"], rel=1e-5), f"step {step + 1}: gradient norm"
        behaviour = transformers.LlamaForCausalLM.from_pretrained(learner.export_hf(), dtype=torch.float32)
        ours = behaviour.state_dict()
        before = initial if step == 0 else trl_states[step - 1]
        moved = 0
        for name, theirs in trl_states[step].items():
            # Adam moves every weight by about LR whatever its gradient's size, so weights whose gradient is
            # near 0 move by float noise: compare the whole update of each parameter.
            update = theirs - before[name]
            error = ((ours[name] - theirs).norm() / update.norm()).item()
            assert error < 1e-3, f"step {step + 1}: the update of {name} differs from TRL's by {error:.1e} (relative)"
            moved += int(update.abs().max().item() > 0.5 * LR)
        assert moved == len(initial), f"step {step + 1}: {len(initial) - moved} of {len(initial)} parameters did not move"
