#!/usr/bin/env bash
# Build speculators' environment under benchmarks/speculators_check/.venv (ignored by git), from PyPI.
# Usage: bash benchmarks/speculators_check/setup.sh [python]   (Python 3.11 or newer, as speculators requires)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${1:-python3}"
if [ ! -x "$here/.venv/bin/python" ]; then
    "$python" -m venv "$here/.venv"
fi
"$here/.venv/bin/python" -m pip install -q --upgrade pip
"$here/.venv/bin/python" -m pip install -q -r "$here/requirements.txt"
# speculators requires torchvision and torchaudio but its EAGLE-3 class uses neither; PyPI's builds of them do not
# match a CPU torch ("operator torchvision::nms does not exist" when transformers imports them), so they go.
"$here/.venv/bin/python" -m pip uninstall -q -y torchvision torchaudio
"$here/.venv/bin/python" -c "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in ('speculators', 'transformers', 'torch')))"
