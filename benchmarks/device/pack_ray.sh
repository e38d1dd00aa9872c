#!/usr/bin/env bash
# A Ray that runs (raylet and GCS included) for an offline GPU machine, small enough to ship with the
# project: the ray 2.60.0 wheel for that machine's Python without rllib, data, serve, train, tune, llm,
# air, jars, the dashboard's web client and bytecode, as .ray/ray-cpXY.tar.xz (about 26 MiB for cp312,
# from a 76 MiB wheel), plus the wheels of Ray's core imports that such an image may lack into .whl/.
# Run from the project root:
#   bash benchmarks/device/pack_ray.sh          # Python 3.12 (the H100/H200 image)
#   bash benchmarks/device/pack_ray.sh 3.11     # this machine's Python: to try the trimmed copy here
# On the GPU machine, after the prelude of shared/device/prepare.sh (which fills /tmp/site):
#   tar xJf .ray/ray-cp312.tar.xz -C /tmp/site
# Keep the version in step with pyproject's ray pin.
set -euo pipefail
py=${1:-3.12}
tag=cp${py/./}
plat=(--only-binary=:all: --python-version "$py" --implementation cp --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx '/.ray/' "$exclude" 2>/dev/null || printf '/.whl/\n/.ray/\n' >> "$exclude"
mkdir -p .ray .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip install -q --no-deps "${plat[@]}" --target "$tmp" ray==2.60.0
(cd "$tmp/ray" && rm -rf rllib data serve train tune llm air jars dashboard/client \
   && find . -name __pycache__ -prune -exec rm -rf {} +)
rm -rf "$tmp/bin"
tar cJf ".ray/ray-$tag.tar.xz" -C "$tmp" ray ray-2.60.0.dist-info
# Ray's core requirements that the image lacks (the others come with it or with prepare.sh's wheels).
python3 -m pip download -q --no-deps "${plat[@]}" -d .whl msgpack==1.2.4 click==8.5.1 filelock==3.32.7
du -sh ".ray/ray-$tag.tar.xz" .whl
