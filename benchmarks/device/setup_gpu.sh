#!/usr/bin/env bash
# Source from the project root on the offline GPU machine (carry .whl and .ray, made by
# shared/device/prepare.sh, given the aiohttp backend's pins too: aiohttp==3.14.5 httpx-aiohttp==0.2.0
# multidict==7.2.1 yarl==1.25.1 frozenlist==1.8.0 aiosignal==1.4.0 propcache==0.5.4
# aiohappyeyeballs==2.7.1 attrs==26.1.0):  source benchmarks/device/setup_gpu.sh
# Our side: the project's wheels in /tmp/site, the project itself as the `marin_rl` namespace in /tmp/mr
# (as an install lays it out). TRL's side (TRL_PYTHONPATH, for bench_vs_trl.py): the image's torch,
# transformers and accelerate, with trl and datasets from .whl in /tmp/trl.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# The runnable Ray of benchmarks/device/pack_ray.sh when it was packed (then run Ray benches from /tmp: actors
# started in the tree find its bare marin_rl/ first), else prepare.sh's import-only one.
if [ -f .ray/ray-cp312.tar.xz ]; then tar xJf .ray/ray-cp312.tar.xz -C /tmp/site; else tar xzf .ray/ray312.tgz -C /tmp/site; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/trl \
  .whl/trl-*.whl .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl
rm -rf /tmp/mr && mkdir -p /tmp/mr && cp -r marin_rl /tmp/mr/
for part in envs orchestrator replay learner broadcaster engine distributed server workers; do ln -s "$PWD/$part" "/tmp/mr/marin_rl/$part"; done
# The image sets PYTHONDONTWRITEBYTECODE=1: without byte-compiling here, every process compiles every
# module it imports again (15 s of a 0.5B run's start-up), which an installed project never does.
python3 -m compileall -q -j0 /tmp/site /tmp/trl "$PWD" > /dev/null
export PYTHONPATH=/tmp/site:/tmp/mr TRL_PYTHONPATH=/tmp/trl PYTHONUNBUFFERED=1
set +e
