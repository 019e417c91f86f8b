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
# keep the torch just installed (a dependency must not swap it for another build)
TORCH_PIN="torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"
.venv/bin/python -m pip install -q -e ".[dev]" "$TORCH_PIN"
# litdata requires torchvision (for image / video serializers attnzoo never uses). The registry's torchvision for
# this torch is built against the CUDA build and fails to import beside the CPU build; installed, it breaks
# `import lightning` (torchmetrics imports torchvision when present). Remove it where it does not import.
if .venv/bin/python -m pip show -q torchvision >/dev/null 2>&1 && ! .venv/bin/python -c "import torchvision" >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y torchvision
fi
# triton for the interpreter tests only (tests/test_fla_interpreter.py: fla's Triton kernels run on this CPU by
# Triton's interpreter), in a folder of its own that only those tests' processes put on their path: importable
# beside fla-core it breaks transformers on a CPU (DESIGN 6.7). About 1 GB installed (a 286 MB wheel).
TRITON_SITE=${ATTNZOO_TRITON_SITE:-.venv/triton-site}
if [ ! -d "$TRITON_SITE/triton" ]; then
  .venv/bin/python -m pip install -q --no-deps --target "$TRITON_SITE" "${ATTNZOO_INTERP_TRITON:-triton==3.9.0}"
fi
