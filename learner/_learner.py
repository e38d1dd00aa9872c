"""The learner: one optimizer step per batch of packed RlExamples, checkpoints, and HF exports.

The learner is algorithm-blind: it applies the per-token advantages and loss weights it is given.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from levanter.models.lm_model import LmHeadModel

from marin_rl.adapters import merged
from marin_rl.engine import ExactLayout
from marin_rl.errors import naming_full_disk
from marin_rl.learner._checkpoint import complete_checkpoints, load_checkpoint, save_checkpoint
from marin_rl.learner._config import LearnerConfig, ModelConfig
from marin_rl.learner._lora import add_adapters, base_fingerprint, save_peft_adapter, trainable_params, with_frozen_base_in
from marin_rl.learner._mesh import LearnerMesh
from marin_rl.learner._model import build_model, cast_floating, compute_dtype, load_hf_model, read_hf_config, save_hf_model
from marin_rl.learner._optim import build_optimizer
from marin_rl.learner._step import loss_and_gradients
from marin_rl.programs import ProgramStore
from marin_rl.rl_example import POS_AXIS, RlExample

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
HF_DIR = "hf"
PEFT_DIR = "peft"
CHECKPOINT_FORMAT = 1


class Learner:
    """Trains a Levanter LM on packed RlExamples.

    - `step(example)` takes one optimizer step and returns its metrics.
    - `policy_version` is the number of optimizer steps taken.
    - `model` is the current model (float32 parameters; with LoRA, float32 adapters on a frozen base
      stored in the compute dtype). Its arrays are never donated to the step, so
      whoever holds it (a colocated inference server) can keep using it after later steps.
    - `save_checkpoint()` / `restore_latest()` / `export()` (`export_hf()`, `export_peft()`) write under
      `run_dir`.
    - `last_logprobs` holds the learner's log-prob of every token of the last step's batch (before its
      update), to compare with the behaviour log-probs.
    """

    def __init__(
        self,
        config: LearnerConfig,
        model_config: ModelConfig,
        run_dir,
        tokenizer,
        *,
        key,
        vocab_size: int | None = None,
        mesh: LearnerMesh | None = None,
        exact: ExactLayout | None = None,
    ):
        """`tokenizer` is saved with HF exports and handed to Levanter's HF loader (None: the checkpoint
        directory's own). A fresh model gets `vocab_size` rows of embedding, by default `len(tokenizer)`.
        `mesh`: train data-parallel over its devices (None: on the default device). `exact`: score with
        the engine's exact passes of this layout (`exact_sequence_logprobs`): the log-probs an engine
        with the same layout and compute dtype sampled with, bit for bit."""
        self.config = config
        self.exact = exact
        self.last_logprobs: np.ndarray | None = None
        self.mesh = mesh
        self.model_config = model_config
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
        init_key, self._key = jax.random.split(key)
        model = _initial_model(config, model_config, tokenizer, init_key, vocab_size, exact)
        self._dtype = compute_dtype(model_config)
        self.model: LmHeadModel = self._place(model)
        optimizer, _ = build_optimizer(config.optimizer)
        # Eager, not jitted: a compiled init may return one buffer for equal zero leaves, and this state is
        # donated to every step.
        self._opt_state = self._place(optimizer.init(trainable_params(self.model)))
        # The KL reference is the initial policy, frozen, kept in the compute dtype.
        self._reference = cast_floating(self.model, self._dtype) if config.loss.beta > 0 else None
        self.policy_version = 0
        self._stored_step: _StoredStep | None = None
        # With LoRA: which base the adapters belong to, saved with each checkpoint. Made here, where its
        # compilation is start-up's, not a checkpoint step's.
        self._base = {"hf_checkpoint": model_config.hf_checkpoint, "fingerprint": base_fingerprint(self.model)} if config.lora.rank else None
        # N of the 6N FLOPs-per-token count: every parameter in a matmul (the input embedding lookup is not one).
        params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
        lookup = 0 if model.config.tie_word_embeddings else model.embeddings.token_embeddings.weight.size
        self.matmul_params = params - lookup

    @staticmethod
    def model_shapes(config: LearnerConfig, model_config: ModelConfig, tokenizer, *, vocab_size: int | None = None, exact: ExactLayout | None = None):
        """The shapes and dtypes of the model a `Learner` of these arguments starts from, its structure and
        static parts (`eqx.filter_eval_shape`: nothing computed, no checkpoint's weights read), for programs
        to compile from while it is built."""
        return eqx.filter_eval_shape(lambda key: _initial_model(config, model_config, tokenizer, key, vocab_size, exact, shapes_only=True), jax.random.key(0))

    @property
    def policy_model(self) -> LmHeadModel:
        """The current policy as a plain model of the base architecture (adapters merged): what an HF
        export holds. Servers get `model` itself (adapters and all; see `marin_rl.adapters`)."""
        return merged(self.model) if self.config.lora.rank else self.model

    # --- training -------------------------------------------------------------------------------------

    def step(self, example: RlExample) -> dict[str, float]:
        """One optimizer step on `example`; returns the step's metrics (see docs/learner.md)."""
        self._key, step_key = jax.random.split(self._key)
        start = time.perf_counter()
        inputs = self._step_inputs(example, step_key)
        train_step = self._stored_step or _train_step
        self.model, self._opt_state, device_metrics, logprobs = train_step(inputs, self._opt_state)
        device_metrics, self.last_logprobs = jax.device_get((device_metrics, logprobs))
        metrics = {name: float(value) for name, value in device_metrics.items()}
        elapsed = time.perf_counter() - start
        self.policy_version += 1
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(f"learner step {self.policy_version}: loss is {metrics['loss']}")
        metrics["step_time_s"] = elapsed
        metrics["tokens_per_s"] = metrics["num_tokens"] / elapsed
        metrics["model_tflops_per_s"] = 6 * self.matmul_params * metrics["tokens_per_s"] / 1e12
        return metrics

    def compile_step(self, example: RlExample) -> float:
        """Compile the step for examples shaped like `example` without running it (the first step then
        starts at once); returns the seconds it took. On one device, with the compilation cache on, the
        program is kept lowered on disk (`ProgramStore`): a warm start neither traces nor lowers it."""
        start = time.perf_counter()
        inputs = self._step_inputs(example, self._key)
        store = ProgramStore.beside_compilation_cache() if self.mesh is None else None
        if store is None:
            _train_step.lower(inputs, self._opt_state).compile()
        else:
            self._stored_step = _StoredStep(store, inputs, self._opt_state)
        return time.perf_counter() - start

    def _step_inputs(self, example: RlExample, step_key):
        self._check_example(example)
        reference = self._reference if example.reference_logprobs is None else None
        step = jnp.asarray(self.policy_version, jnp.int32)
        if self.mesh is not None:
            example = self.mesh.place_batch(example)
        return (self.config, self._dtype, self.model, example, reference, step_key, step, self.mesh, self.exact)

    def _place(self, tree):
        """On the learner's devices and committed there, as its step's outputs are: a state placed
        otherwise (a Hugging Face checkpoint's, a restored one's) made the step compile again at step 2."""
        if self.mesh is not None:
            return self.mesh.place_params(tree)
        device = jax.devices()[0]
        return jax.tree.map(lambda x: jax.device_put(x, device) if eqx.is_array(x) else x, tree)

    def _check_example(self, example: RlExample) -> None:
        positions = example.input_ids.resolve_axis(POS_AXIS).size
        if positions > self.model_config.seq_len:
            raise ValueError(
                f"RlExample rows have {positions} positions, more than "
                f"ModelConfig.seq_len = {self.model_config.seq_len}"
            )

    # --- checkpoints and exports ----------------------------------------------------------------------

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    def _config_record(self) -> dict:
        return {"learner": draccus.encode(self.config), "model": draccus.encode(self.model_config)}

    def save_checkpoint(self, run_state: dict | None = None) -> Path:
        """Write `RUN/checkpoints/step-{policy_version}/` atomically; keeps the newest
        `LearnerConfig.keep_checkpoints`. `run_state` (JSON-able: what the rest of the loop needs to
        continue, e.g. each env's problem-stream position) is saved with it."""
        record = self._config_record()
        state = {
            "run": run_state or {},
            "format": CHECKPOINT_FORMAT,
            "step": self.policy_version,
            "policy_version": self.policy_version,
            "rng_key": np.asarray(jax.random.key_data(self._key)).tolist(),
            "config_hash": _hash(record),
            "config": record,
        }
        if self.config.lora.rank:  # the adapters alone, and which base they go on
            state["base"] = self._base
        return save_checkpoint(
            self.checkpoints_dir,
            self.policy_version,
            model=self._checkpointed_part(),
            opt_state=self._opt_state,
            state=state,
            keep=self.config.keep_checkpoints,
        )

    def restore_latest(self) -> dict | None:
        """Load the newest complete checkpoint under `RUN/checkpoints/`, if any; returns the `run_state`
        saved with it ({} if none was), or None when there is no checkpoint."""
        checkpoints = complete_checkpoints(self.checkpoints_dir)
        if not checkpoints:
            return None
        path = checkpoints[-1]
        lora = bool(self.config.lora.rank)
        check_base = (lambda state: self._check_base(path, state.get("base"))) if lora else None
        model, opt_state, state = load_checkpoint(path, model_like=self._checkpointed_part(), opt_state_like=self._opt_state, check_state=check_base)
        if state["config_hash"] != _hash(self._config_record()):
            logger.warning("checkpoint %s was written with another config: %s", path, state["config"])
        if lora:
            model = eqx.combine(model, self.model)  # the saved adapters on this (the same) base
        self.model, self._opt_state = self._place(model), self._place(opt_state)
        self.policy_version = state["policy_version"]
        key_data = jnp.asarray(state["rng_key"], dtype=jnp.uint32)
        typed = jnp.issubdtype(self._key.dtype, jax.dtypes.prng_key)
        self._key = jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(self._key)) if typed else key_data
        logger.info("restored %s (policy version %d)", path, self.policy_version)
        return state.get("run", {})

    def _checkpointed_part(self):
        """What a checkpoint holds of the model: with LoRA the adapters alone (the base is rebuilt), else all."""
        return trainable_params(self.model) if self.config.lora.rank else self.model

    def _check_base(self, path: Path, saved: dict | None) -> None:
        """ValueError unless the checkpoint at `path` holds adapters for this learner's base."""
        if saved is None:
            raise ValueError(f"checkpoint {str(path)!r} holds a whole model, not LoRA adapters: it was written with learner.lora.rank 0")
        ours = self._base
        if saved["hf_checkpoint"] != ours["hf_checkpoint"]:
            raise ValueError(
                f"checkpoint {str(path)!r} holds adapters for the base model.hf_checkpoint={saved['hf_checkpoint']!r}, "
                f"this run's is {ours['hf_checkpoint']!r}"
            )
        if not np.allclose(saved["fingerprint"], ours["fingerprint"], rtol=1e-5):
            raise ValueError(
                f"checkpoint {str(path)!r} holds adapters for other base weights than this run's (model.hf_checkpoint="
                f"{ours['hf_checkpoint']!r}; a random base differs with the seed or the model's shape)"
            )

    def export(self) -> list[Path]:
        """The run's exports at this policy version: Hugging Face weights (adapters merged), and with LoRA
        the PEFT adapter too."""
        return [self.export_hf(), *([self.export_peft()] if self.config.lora.rank else [])]

    def export_peft(self, step: int | None = None) -> Path:
        """Write the adapters as a PEFT adapter directory to `RUN/peft/step-N/` (N = `step`, default the
        policy version), which `peft` loads onto the Hugging Face base (`model.hf_checkpoint`, recorded as
        its `base_model_name_or_path`); returns its path. Only with LoRA."""
        if not self.config.lora.rank:
            raise ValueError("export_peft needs LoRA adapters (learner.lora.rank > 0)")
        step = self.policy_version if step is None else step
        path = self.run_dir / PEFT_DIR / f"step-{step}"
        with naming_full_disk(path):
            return save_peft_adapter(self.model, self.config.lora, self.model_config.hf_checkpoint, path, self.tokenizer)

    def export_hf(self, step: int | None = None) -> Path:
        """Write the current model as a Hugging Face checkpoint to `RUN/hf/step-N/` (N = `step`, default the
        policy version), atomically; returns its path."""
        step = self.policy_version if step is None else step
        dtype = jnp.dtype(self.config.export_dtype)
        path = self.run_dir / HF_DIR / f"step-{step}"
        with naming_full_disk(path):
            return save_hf_model(self.policy_model, self.tokenizer, path, dtype=dtype)


def _initial_model(config: LearnerConfig, model_config: ModelConfig, tokenizer, key, vocab_size, exact, *, shapes_only: bool = False) -> LmHeadModel:
    """The checkpoint's model or a fresh one, with LoRA adapters where configured. `shapes_only` (traced
    under `eqx.filter_eval_shape`): a checkpoint's model is built from its config, its weights not read."""
    path = model_config.hf_checkpoint
    if path is not None and not shapes_only:
        model = load_hf_model(path, model_config, tokenizer=tokenizer)
    elif path is not None:  # the converter's own template: the checkpoint's config, its vocabulary size
        hf_config = read_hf_config(Path(path).resolve())
        model = build_model(model_config, hf_config.vocab_size, key=key, hf_config=hf_config)
    else:
        model = build_model(model_config, vocab_size or len(tokenizer), key=key)
    if config.lora.rank:
        if exact is not None:
            raise ValueError("LoRA (learner.lora.rank > 0) with exact numerics is not supported: the engine serves merged weights")
        key, lora_key = jax.random.split(key)
        model = with_frozen_base_in(add_adapters(model, config.lora, key=lora_key), compute_dtype(model_config))
    return model


# Module level, with the configs as static arguments, so learners with equal configs share compilations.
# The optimizer state (second argument) is donated: only the learner holds it. The model is not.
def _train_step_body(inputs, opt_state):
    """Loss and gradients over microbatches, then the optimizer update."""
    config, dtype, model, example, reference, key, step, mesh, exact = inputs
    loss, grads, metrics, logprobs = loss_and_gradients(
        model, example, config=config, compute_dtype=dtype, reference=reference, key=key, exact=exact
    )
    optimizer, schedule = build_optimizer(config.optimizer)
    updates, opt_state = optimizer.update(grads, opt_state, trainable_params(model))
    model = eqx.apply_updates(model, updates)
    if mesh is not None:  # keep the placement the step was compiled for (else the next step recompiles)
        model, opt_state = mesh.place_params((model, opt_state))
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(step)}
    return model, opt_state, metrics, logprobs


_train_step = eqx.filter_jit(donate="all-except-first")(_train_step_body)

_MODEL = 2
"""The model's place in the step's inputs (`Learner._step_inputs`)."""


class _StoredStep:
    """`_train_step` for inputs of one structure and shape, compiled through a `ProgramStore`; inputs of
    another take `_train_step` itself. Its arguments are the arrays: the model's (returned updated, not
    donated), the optimizer state's (donated) and the rest; the non-array parts key the stored program."""

    def __init__(self, store: ProgramStore, inputs, opt_state):
        args, static = self._split(inputs, opt_state)
        self._signature = _signature(args)
        self._run = store.compile(
            "learner_step", _stored_step_body, args, (static,), donate_argnums=(1,), returns_like=(0, 1), context=""
        )

    def __call__(self, inputs, opt_state):
        args, (inputs_static, opt_static) = self._split(inputs, opt_state)
        if _signature(args) != self._signature:
            return _train_step(inputs, opt_state)
        model_arrays, opt_arrays, metrics, logprobs = self._run(*args)
        model = eqx.combine(model_arrays, inputs_static[_MODEL])
        return model, eqx.combine(opt_arrays, opt_static), metrics, logprobs

    @staticmethod
    def _split(inputs, opt_state):
        """((model arrays, optimizer state arrays, other input arrays), (non-array parts of the inputs,
        of the optimizer state))."""
        (inputs_arrays, opt_arrays), static = eqx.partition((inputs, opt_state), eqx.is_array)
        others = (*inputs_arrays[:_MODEL], None, *inputs_arrays[_MODEL + 1 :])
        return (inputs_arrays[_MODEL], opt_arrays, others), static


def _stored_step_body(model_arrays, opt_arrays, others, static):
    inputs_arrays = (*others[:_MODEL], model_arrays, *others[_MODEL + 1 :])
    inputs, opt_state = eqx.combine((inputs_arrays, opt_arrays), static)
    model, opt_state, metrics, logprobs = _train_step_body(inputs, opt_state)
    return eqx.filter(model, eqx.is_array), eqx.filter(opt_state, eqx.is_array), metrics, logprobs


def _signature(tree):
    leaves, structure = jax.tree.flatten(tree)
    return structure, [(x.shape, x.dtype) for x in leaves]


def _hash(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
