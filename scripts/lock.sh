#!/usr/bin/env bash
# Refresh requirements-dev.lock: every package `pip install -e ".[dev,ray]"` resolves, pinned. torch itself is
# left out: it keeps the README's own install line (a local CPU build here, a CUDA build on PyPI), and the
# packages torch needs are resolved for that release.
#   bash scripts/lock.sh      (in the dev environment, which has pip-tools)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
grep -m1 -o 'torch==[0-9.]*' README.md > build/torch-pin.txt
CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" python -m piptools compile --quiet --upgrade --extra dev --extra ray \
    --strip-extras --no-emit-index-url --no-emit-find-links --unsafe-package torch --unsafe-package minigpt \
    --constraint build/torch-pin.txt --output-file requirements-dev.lock pyproject.toml
