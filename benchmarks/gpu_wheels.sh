#!/usr/bin/env bash
# Here, before a GPU session (issue 50): the wheels the device machine's Python 3.12 lacks, into .whl/ (ignored by
# git, carried by the device tool: `carry: [".whl"]`). Versions are this checkout's .venv's, so the GPU runs what
# the tests ran. deepspeed has no wheel on PyPI: it is built here without its ops (DS_BUILD_OPS=0, JIT on the GPU).
# kdcache itself is installed on the device from the carried tree (benchmarks/gpu_check.sh), never a stale wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
version() { "$PIP" show "$1" | sed -n 's/^Version: //p'; }
PURE="zarr donfig datasets dill multiprocess pydantic annotated-types typing-inspection hjson array-api-compat"
BUILT="numcodecs crc32c google-crc32c pydantic-core"
pins=()
for name in $PURE $BUILT; do pins+=("$name==$(version "$name")"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 \
    -d .whl "${pins[@]}"
DS_BUILD_OPS=0 "$PIP" wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(version deepspeed)"
ls -la .whl
du -sh .whl
