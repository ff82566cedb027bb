"""Where the Triton kernel tests run: on a GPU, or on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, Triton on PYTHONPATH); anywhere else (CI: no GPU, no Triton) their
modules are skipped whole."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device() -> str:
    """The device the kernels run on ("cuda", or "cpu" under the interpreter); skips the
    importing module where they cannot run (call it before importing any Triton module)."""
    if importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or INTERPRET):
        pytest.skip("needs Triton, and a GPU or TRITON_INTERPRET=1", allow_module_level=True)
    return "cpu" if INTERPRET else "cuda"
