"""vLLM-harness tests: only run where vLLM is installed (``.venv-vllm``).

The repo runs with ``filterwarnings = error``; importing vLLM 0.32 (CPU build) triggers a
torch deprecation warning (``vllm/utils/deep_gemm.py`` applies ``@torch.compile`` at import
time, which imports ``torch.utils.mkldnn``'s ``torch.jit.script_method``).  Ignore exactly
that, nothing else.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is not None:  # session fixtures of the vLLM tests
    from tests.vllm._fixtures import tiny_llama_dir  # noqa: F401

_VLLM_IMPORT_WARNINGS = (r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning",)


def pytest_configure(config: pytest.Config) -> None:
    for line in _VLLM_IMPORT_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
