"""The interpreter tier: fla's Triton kernels run by Triton's interpreter on this CPU (ops/triton_interpreter.py).

Collected only in the process tests/test_fla_interpreter.py starts, where triton is on the path and
TRITON_INTERPRET=1 (the rest of the suite never sees triton: DESIGN 6.7). Run by hand:
    TRITON_INTERPRET=1 ATTNZOO_INTERP_TESTS=1 PYTHONPATH=.venv/triton-site .venv/bin/python -m pytest -n 0 tests/interp
"""
import pytest

from attnzoo.ops import dispatch
from attnzoo.ops.triton_interpreter import interpreting


def pytest_configure(config):
    if not interpreting():
        raise pytest.UsageError("tests/interp runs under Triton's interpreter: set TRITON_INTERPRET=1 (and put triton "
                                "on PYTHONPATH; tests/test_fla_interpreter.py does both)")
    if not dispatch.fla_available():
        raise pytest.UsageError("tests/interp needs triton and fla-core importable (scripts/setup.sh installs triton "
                                "into .venv/triton-site)")
