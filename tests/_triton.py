"""Imports graphshard's Triton kernels for tests: on a machine without a GPU, under Triton's
interpreter, which ``@triton.jit`` picks when the kernel module is imported. The variable is set
only for that import and put back after, so the rest of the session (and the processes it
starts) does not inherit it."""

from __future__ import annotations

import importlib
import os

import pytest
import torch


def import_kernel(module: str):
    """``module`` (graphshard's Triton kernels, or the op that runs them), skipping the test module
    where triton is not installed."""
    saved = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        importlib.import_module("graphshard.kernels.triton_tbe")  # the kernels, under the interpreter
        return importlib.import_module(module)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
