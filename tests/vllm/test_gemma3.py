"""``AiokvConnector`` end to end on a two-group model: the tiny random-weight Gemma 3 (``make_tiny_gemma3``: layers
alternate sliding-window attention, a 64-token window, and full attention), every prompt several windows long.

The connector is ``SupportsHMA``, so vLLM 0.32 keeps its hybrid KV-cache manager on with it: two KV-cache groups (a
``SlidingWindowSpec`` group and a ``FullAttentionSpec`` group overlaying one buffer, 1024 blocks in 64 MiB), and
aiokv stores them as a grouped layout: every full-attention block, and the sliding group's blocks only where a
kept boundary needs its window (a restore of ``N`` blocks loads the ``N`` full-attention blocks and the window's
two). The same rounds run on a connector engine with the hybrid manager off (``disable_hybrid_kv_cache_manager``):
one group holding every layer, sliding ones allocated like full attention (512 blocks in the same memory).

The engines run in one subprocess (tests/vllm/_gemma3_run.py, four engine starts); "equal" means what it means in
test_engine_connector: token ids exactly, logprobs bit for bit within one engine and to ``LOGPROB_ATOL`` across
engines. One exception within a connector engine: a prompt whose hit leaves one token to compute differs from its
full prefill by ~1e-6, in vLLM's own prefix cache as much as when restored from aiokv (the two agree bit for bit).
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

from tests.vllm._baseline_run import BLOCK_SIZE
from tests.vllm._connector_run import BATCH_N
from tests.vllm._gemma3_run import HMA_BATCH_TOKENS, PROMPT_LENS, SLIDING_WINDOW, TURN1_LEN, TURN1_TOKENS
from tests.vllm._model import make_tiny_gemma3
from tests.vllm.test_engine_connector import assert_same, hit

REPO = Path(__file__).resolve().parents[2]
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The runner's results (its engines: no connector, connector, connector with a small KV cache)."""
    model = make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), sliding_window=SLIDING_WINDOW)
    out = tmp_path_factory.mktemp("gemma3") / "result.json"
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the runner's probes: functions sent to the worker
    }
    cmd = [sys.executable, "-m", "tests.vllm._gemma3_run", "--model", str(model), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"gemma3 runner failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _delta(run: dict[str, Any], before: str, after: str, counter: str) -> int:
    stats_before, stats_after = run[before]["stats"], run[after]["stats"]
    return int(stats_after[counter] - stats_before[counter])


WINDOW_BLOCKS = (
    SLIDING_WINDOW // BLOCK_SIZE
)  # the sliding group's blocks a restore needs (tokens N*bs-63..N*bs-1)


def loaded_units(engine: str, hit_tokens: int) -> int:
    """Units a restore of ``hit_tokens`` loads: with two groups a block of the full-attention group (two layers) per
    block, and the window's blocks of the sliding group; with one group a block of all four layers per block."""
    n = hit_tokens // BLOCK_SIZE
    return n + min(n, WINDOW_BLOCKS) if engine == "conn" else n


ENGINES = [pytest.param("conn", id="hybrid"), pytest.param("off", id="hybrid_off")]


def test_kv_cache_groups_kept_with_the_connector(gemma3: dict[str, Any]) -> None:
    plain, conn, off = gemma3["plain_probe"], gemma3["conn_probe"], gemma3["off_probe"]
    groups = [
        ("SlidingWindowSpec", SLIDING_WINDOW, [LAYERS[0], LAYERS[2]]),
        ("FullAttentionSpec", None, [LAYERS[1], LAYERS[3]]),
    ]
    assert [(g["spec"], g["sliding_window"], g["layers"]) for g in plain["groups"]] == groups
    assert [(g["spec"], g["sliding_window"], g["layers"]) for g in conn["groups"]] == groups
    assert plain["num_blocks"] == conn["num_blocks"] == 1024  # the groups overlay one buffer
    assert conn["grouped"]
    assert conn["layout"].startswith("2 groups (sliding_window0=sliding_window/64,full1=full)")
    # The hybrid manager off: the sliding layers become full-attention ones (the spec keeps the window).
    assert [(g["spec"], g["layers"]) for g in off["groups"]] == [("FullAttentionSpec", LAYERS)]
    assert off["num_blocks"] == 512
    assert not off["grouped"]
    assert plain["stats"] is None
    assert conn["stats"] is not None


@pytest.mark.parametrize("engine", ENGINES)
def test_outputs_equal_without_connector(gemma3: dict[str, Any], engine: str) -> None:
    plain, conn = gemma3["plain"], gemma3[engine]
    assert max(PROMPT_LENS) > 4 * SLIDING_WINDOW
    for i, n in enumerate(PROMPT_LENS):
        assert conn["round1"][i]["num_cached_tokens"] == 0, n
        assert_same(conn["round1"][i], plain["round1"][i], exact=False, what=f"round 1, {n} tokens")


@pytest.mark.parametrize("engine", ENGINES)
def test_reset_round_restores_from_aiokv(gemma3: dict[str, Any], engine: str) -> None:
    plain, conn = gemma3["plain"], gemma3[engine]
    assert conn["reset1"] >= 1
    assert plain["reset1"] >= 1
    assert [r["num_cached_tokens"] for r in conn["round2"]] == [hit(n) for n in PROMPT_LENS]
    assert [r["num_cached_tokens"] for r in plain["round2"]] == [0] * len(PROMPT_LENS)
    # Every hit block came from aiokv (vLLM's own cache was reset).
    units = sum(loaded_units(engine, hit(n)) for n in PROMPT_LENS)
    assert units > 0
    assert _delta(conn, "probe_before_round2", "probe_after_round2", "blocks_loaded") == units
    assert _delta(conn, "probe_before_round2", "probe_after_round2", "load_errors") == 0
    for i, n in enumerate(PROMPT_LENS):
        # Restored from aiokv == from vLLM's own prefix cache, bit for bit; == computed from scratch too, bit for
        # bit, except where the hit leaves one token to compute (129 tokens): there vLLM's own cache differs from
        # the full prefill by ~1e-6 in this engine as well, and aiokv's restore agrees with it.
        one_left = n - hit(n) == 1
        assert_same(conn["round2"][i], conn["repeat"][i], exact=True, what=f"restored vs vLLM cache, {n}")
        assert_same(
            conn["round2"][i], conn["round1"][i], exact=not one_left, what=f"restored vs computed, {n}"
        )
        assert_same(conn["round2"][i], plain["round2"][i], exact=False, what=f"restored vs no connector, {n}")
        # vLLM's own prefix cache, hybrid manager on: the same hits (a sliding group's hit needs only the window).
        assert plain["repeat"][i]["num_cached_tokens"] == hit(n)


@pytest.mark.parametrize("engine", ENGINES)
def test_multi_turn_restores_the_final_block(gemma3: dict[str, Any], engine: str) -> None:
    plain, conn = gemma3["plain"], gemma3[engine]
    assert (TURN1_LEN + TURN1_TOKENS - 1) % BLOCK_SIZE == 0
    assert_same(conn["turn1"], plain["turn1"], exact=False, what="turn 1")
    assert len(conn["turn1"]["token_ids"]) == TURN1_TOKENS
    assert conn["reset2"] >= 1
    restored = conn["turn2"]["num_cached_tokens"]
    assert restored == hit(conn["turn2_len"]) == TURN1_LEN + TURN1_TOKENS - 1
    assert restored - TURN1_LEN > SLIDING_WINDOW  # more than a window of generated tokens
    loaded = _delta(conn, "probe_before_turn2", "probe_after_turn2", "blocks_loaded")
    # The last block was completed by turn 1's final decode step; with two groups the window units of that final
    # boundary were stored at turn 1's end (no checkpoint or prompt end lies there).
    assert loaded == loaded_units(engine, restored)
    assert plain["turn2"]["num_cached_tokens"] == 0
    assert conn["turn2_repeat"]["num_cached_tokens"] == restored
    assert_same(conn["turn2"], conn["turn2_repeat"], exact=True, what="turn 2 restored vs vLLM cache")
    assert_same(conn["turn2"], plain["turn2"], exact=False, what="turn 2 vs no connector")


def test_preemption_with_small_cache_stays_exact(gemma3: dict[str, Any]) -> None:
    """Hybrid manager on, a small KV cache: preemptions, and the sliding-window blocks vLLM frees as they leave the
    window handed out again at once (the connector drops them from aiokv's tables and fences the copies reading
    them before the forward that may write them)."""
    small, ref = gemma3["small_batch"], gemma3["plain_batch"]
    assert len(small) == len(ref) == BATCH_N
    preemptions = [r["num_preemptions"] for r in small]
    assert sum(preemptions) > 0, preemptions
    for i, (a, b) in enumerate(zip(small, ref, strict=True)):
        assert len(a["token_ids"]) == HMA_BATCH_TOKENS
        assert_same(a, b, exact=False, what=f"batch prompt {i} (preemptions {preemptions[i]})")
    probe = gemma3["small_probe"]
    assert probe["grouped"]
    assert probe["blocks_dropped"] > 0
    stats = probe["stats"]
    assert stats["load_errors"] == stats["store_errors"] == 0
