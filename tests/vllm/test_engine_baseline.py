"""vLLM itself, without a connector, on the tiny model: the facts the connector tests build on.

The engine runs in a subprocess (tests/vllm/_baseline_run.py): engine start takes ~40 s on two cores.
``tiny_llama_dir`` comes from tests/vllm/_fixtures.py through the conftest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.vllm._baseline_run import BLOCK_SIZE, MAX_TOKENS, PROMPT_LEN

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("baseline") / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm._baseline_run", "--model", str(tiny_llama_dir), "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


pytestmark = pytest.mark.timeout(600)


def test_a_prompt_generates(baseline: dict[str, Any]) -> None:
    first = baseline["first"]
    assert len(first["token_ids"]) == MAX_TOKENS
    assert first["finish_reason"] == "length"
    assert len(first["logprobs"]) == MAX_TOKENS
    assert first["num_cached_tokens"] == 0


def test_different_prompts_give_different_tokens(baseline: dict[str, Any]) -> None:
    assert baseline["other"]["token_ids"] != baseline["first"]["token_ids"]


def test_vllm_prefix_cache_hits_full_blocks(baseline: dict[str, Any]) -> None:
    # The last prompt token is always recomputed, so a repeat hits every full block before it.
    assert baseline["repeat"]["num_cached_tokens"] == (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert baseline["repeat"]["token_ids"] == baseline["first"]["token_ids"]


def test_reset_prefix_cache_then_identical_recompute(baseline: dict[str, Any]) -> None:
    assert baseline["reset_ok"] is True
    again = baseline["after_reset"]
    assert again["num_cached_tokens"] == 0
    assert again["token_ids"] == baseline["first"]["token_ids"]
    assert again["logprobs"] == baseline["first"]["logprobs"]  # exact floats, not approx
    assert again["cumulative_logprob"] == baseline["first"]["cumulative_logprob"]
