#!/usr/bin/env bash
# Creates .venv (if missing) with PyTorch and attnzoo installed (editable, with the test extras).
# ATTNZOO_TORCH overrides the torch requirement (default: the pinned CPU build this project tests with;
# GPU users: ATTNZOO_TORCH="torch" or install their CUDA build into .venv first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "${ATTNZOO_TORCH:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
