"""Session fixtures for the vLLM tests; tests/vllm/conftest.py imports them (``from tests.vllm._fixtures import ...``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm._model import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Llama checkpoint (``make_tiny_llama``'s defaults), made once per session."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
