"""`marin-rl serve`: a server process that loads an HF checkpoint and takes new weights over HTTP.

    python -m marin_rl.server --checkpoint DIR [--server.port 8000] ...

POST /v1/weights/update (bearer token) loads a new checkpoint and swaps it in, POST /v1/weights/upload
takes the weights as the request's body; see docs/serving.md.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import threading

from marin_rl.compiles import enable_compilation_cache, prepare_process
from marin_rl.server._config import ServeConfig

logger = logging.getLogger(__name__)


def serve_main(config: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    prepare_process()
    # Heavy imports after the config is parsed.
    import equinox as eqx
    import jax

    from marin_rl.interpreter import tune_interpreter
    from marin_rl.server._policy_server import PolicyServer, bind_socket
    from marin_rl.tokenizer import load_tokenizer

    _check_checkpoint_dir(config.checkpoint)
    enable_compilation_cache(config.compilation_cache)
    sock = bind_socket(config.server)  # a port in use is named now, not after the model loaded
    tokenizer = load_tokenizer(config.tokenizer or config.checkpoint)
    model = load_checkpoint(config.checkpoint, tokenizer=tokenizer)
    load = functools.partial(load_update, tokenizer=tokenizer, template=eqx.filter_eval_shape(lambda m: m, model))
    server = PolicyServer(config.server, model, tokenizer, config.policy_version, weight_loader=load)
    del model  # the server holds its own copy

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start(sock)
    tune_interpreter(jax.default_backend())  # for the process's life
    logger.info("serving %s (policy version %d) at %s", config.checkpoint, config.policy_version, server.base_url)
    if config.ready_file is not None:
        _write_atomically(config.ready_file, json.dumps({"base_url": server.base_url, "pid": os.getpid()}))
    try:
        stop.wait()
    finally:
        server.shutdown()


def load_update(weights: str | bytes, *, tokenizer, template):
    """The weights of an update: an HF checkpoint directory, or safetensors bytes (HF names) shaped like
    `template` (the served model, or its `eqx.filter_eval_shape`)."""
    if isinstance(weights, str):
        return load_checkpoint(weights, tokenizer=tokenizer)
    from marin_rl.weight_bytes import weights_from_bytes

    return weights_from_bytes(weights, template)


def load_checkpoint(path: str, *, tokenizer):
    """The checkpoint's model (family from its config.json); the engine casts it to its serving dtype."""
    from transformers import AutoConfig

    from marin_rl.learner import ModelConfig, load_hf_model

    _check_checkpoint_dir(path)
    family = AutoConfig.from_pretrained(path, local_files_only=True).model_type
    return load_hf_model(path, ModelConfig(family=family), tokenizer=tokenizer)


def _check_checkpoint_dir(path: str) -> None:
    # transformers takes a path that is not a directory for a hub name and tries to download it.
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"checkpoint {path!r} is not a local Hugging Face checkpoint directory (no config.json in it)")


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

