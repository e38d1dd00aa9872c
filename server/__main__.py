"""`python -m marin_rl.server --checkpoint DIR ...`: `marin-rl serve` without the CLI."""

import logging

import draccus

from marin_rl.server import ServeConfig, serve_main

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
serve_main(draccus.parse(ServeConfig))
