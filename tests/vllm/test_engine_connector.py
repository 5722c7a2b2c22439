"""``AiokvConnector`` end to end: ``LLM.generate`` on the tiny random-weight Llama, with and without the connector.

The engines run in subprocesses (tests/vllm/_connector_run.py, one per scenario group, each starting the engines it
needs once); ``vllm serve``'s module runs as a server process. ``tiny_llama_dir`` comes from tests/vllm/_fixtures.py.

What "equal" means here. Token ids are compared exactly everywhere. Logprobs are compared bit for bit wherever the
forwards are the same computation: a request restored from aiokv after ``reset_prefix_cache()`` against the same
engine's run of it computed from scratch and its run from vLLM's own prefix cache. Across engines logprobs agree
to ``LOGPROB_ATOL``, not bit for bit, and that is vLLM's doing: in vLLM 0.32 on this CPU, any KV connector, even one
whose every method does nothing, moves some decode steps' logprobs by a few float32 ulps (up to ~2e-6 on a
logprob of ~-5; the prefill's first token is identical), and so do different batch compositions (a batch of
requests scheduled into a smaller KV cache, or with loads that finish a step apart). A restore of wrong KV moves
logprobs by orders of magnitude more and changes tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.vllm._baseline_run import BLOCK_SIZE
from tests.vllm._connector_run import (
    BATCH_N,
    BATCH_TOKENS,
    LAST_LEN,
    MAX_TOKENS,
    PROMPT_LENS,
    TURN1_LEN,
    TURN1_TOKENS,
    batch_prompts,
    single_prompts,
)

REPO = Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 2e-5
BAD_KEY_ERROR = "kv_connector_extra_config has unknown key(s) 'tierz'"
KV_TRANSFER_JSON = json.dumps(
    {
        "kv_connector": "AiokvConnector",
        "kv_connector_module_path": "aiokv.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": "cpu=256MiB", "load_policy": "always"},
    }
)

pytestmark = pytest.mark.timeout(900)


def hit(n: int) -> int:
    """Tokens a prefix cache can serve for an n-token prompt: every full block before its last token."""
    return (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def run_scenario(
    scenario: str,
    model: Path,
    out: Path,
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    cmd = [
        sys.executable,
        "-m",
        "tests.vllm._connector_run",
        scenario,
        "--model",
        str(model),
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        [*cmd, *extra],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    # vLLM logs to stdout, Python tracebacks go to stderr.
    assert proc.returncode == 0, f"{scenario} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result, proc


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aiokv-disk")


@pytest.fixture(scope="module")
def main_run(
    tiny_llama_dir: Path, disk_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], str]:
    """The ``main`` group: returns its results and its stdout + stderr (vLLM's engine-core logs)."""
    out = tmp_path_factory.mktemp("connector-main") / "result.json"
    result, proc = run_scenario("main", tiny_llama_dir, out, timeout=600, extra=("--disk-dir", str(disk_dir)))
    return result, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def main(main_run: tuple[dict[str, Any], str]) -> dict[str, Any]:
    return main_run[0]


def assert_same(a: dict[str, Any], b: dict[str, Any], *, exact: bool, what: str) -> None:
    """Same tokens; logprobs bit for bit (``exact``) or to ``LOGPROB_ATOL`` (same token ids and ranks per step)."""
    assert a["token_ids"] == b["token_ids"], what
    assert len(a["token_ids"]) == len(a["logprobs"]), what
    if exact:
        assert a["logprobs"] == b["logprobs"], what
        assert a["cumulative_logprob"] == b["cumulative_logprob"], what
        return
    for step, (sa, sb) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
        assert [(t, r) for t, _, r in sa] == [(t, r) for t, _, r in sb], f"{what}: step {step}"
        for (_, la, _), (_, lb, _) in zip(sa, sb, strict=True):
            assert abs(la - lb) <= LOGPROB_ATOL, f"{what}: step {step}: {la} vs {lb}"


# ---------------------------------------------------------------------------------------------------- 1. reset
def test_outputs_equal_without_connector(main: dict[str, Any]) -> None:
    plain, conn = main["plain"], main["conn"]
    for i, n in enumerate(PROMPT_LENS):
        assert conn["round1"][i]["num_cached_tokens"] == 0, n
        assert len(conn["round1"][i]["token_ids"]) == MAX_TOKENS
        assert_same(conn["round1"][i], plain["round1"][i], exact=False, what=f"round 1, {n} tokens")


def test_reset_round_restores_from_aiokv(main: dict[str, Any]) -> None:
    plain, conn = main["plain"], main["conn"]
    assert conn["reset1"] >= 1  # the attempt that succeeded (0: none did)
    assert plain["reset1"] >= 1
    assert [r["num_cached_tokens"] for r in conn["round2"]] == [hit(n) for n in PROMPT_LENS]
    assert any(hit(n) for n in PROMPT_LENS)
    assert [r["num_cached_tokens"] for r in plain["round2"]] == [0] * len(PROMPT_LENS)
    for i, n in enumerate(PROMPT_LENS):
        # Restored from aiokv == computed == from vLLM's own prefix cache, in the connector engine: bit for bit.
        assert_same(
            conn["round2"][i], conn["round1"][i], exact=True, what=f"restored vs computed, {n} tokens"
        )
        assert_same(
            conn["round2"][i], conn["repeat"][i], exact=True, what=f"restored vs vLLM cache, {n} tokens"
        )
        assert_same(conn["round2"][i], plain["round2"][i], exact=False, what=f"restored vs no connector, {n}")
        assert_same(plain["round2"][i], plain["round1"][i], exact=True, what=f"no connector recompute, {n}")


# ---------------------------------------------------------------------------------------------- 2. multi-turn
def test_multi_turn_restores_generated_tokens(main: dict[str, Any]) -> None:
    plain, conn = main["plain"], main["conn"]
    # Turn 1's last decode step completes a block: TURN1_LEN + TURN1_TOKENS - 1 tokens have KV.
    assert (TURN1_LEN + TURN1_TOKENS - 1) % BLOCK_SIZE == 0
    assert_same(conn["turn1"], plain["turn1"], exact=False, what="turn 1")
    assert len(conn["turn1"]["token_ids"]) == TURN1_TOKENS
    assert conn["reset2"] >= 1
    restored = conn["turn2"]["num_cached_tokens"]
    assert restored == hit(conn["turn2_len"]) == TURN1_LEN + TURN1_TOKENS - 1
    assert (
        restored > TURN1_LEN
    )  # past turn 1's prompt: decode blocks, the last one completed by the final step
    assert plain["turn2"]["num_cached_tokens"] == 0
    assert conn["turn2_repeat"]["num_cached_tokens"] == restored  # vLLM's own prefix cache, same blocks
    assert_same(conn["turn2"], conn["turn2_repeat"], exact=True, what="turn 2 restored vs vLLM cache")
    assert_same(conn["turn2"], plain["turn2"], exact=False, what="turn 2 vs no connector")


# ---------------------------------------------------------------------------------------------- 4. preemption
def test_preemption_with_small_cache_stays_exact(main: dict[str, Any]) -> None:
    small, ref = main["small_batch"], main["plain_batch"]
    assert len(small) == len(ref) == BATCH_N
    preemptions = [r["num_preemptions"] for r in small]
    assert sum(preemptions) > 0, preemptions  # the small KV cache did preempt
    for i, (a, b) in enumerate(zip(small, ref, strict=True)):
        assert len(a["token_ids"]) == BATCH_TOKENS
        assert_same(a, b, exact=False, what=f"batch prompt {i} (preemptions {preemptions[i]})")
    assert_same(main["small_last"], main["plain_last"], exact=False, what="last prompt")


# ---------------------------------------------------------------------------------------------- 5. bad config
def test_bad_connector_config_fails_start_up(main_run: tuple[dict[str, Any], str]) -> None:
    result, logs = main_run
    assert result["bad"]["raised"] is True
    assert BAD_KEY_ERROR in result["bad"]["text"] or BAD_KEY_ERROR in logs, result["bad"]


# ---------------------------------------------------------------------------------------------- 3. disk tier
def test_second_process_restores_from_disk(
    main: dict[str, Any], tiny_llama_dir: Path, disk_dir: Path, tmp_path: Path
) -> None:
    files = sorted(p.name for p in disk_dir.iterdir())
    assert any(name.endswith(".akv") for name in files), (
        files
    )  # written by main's small engine, then it exited
    result, _ = run_scenario(
        "disk", tiny_llama_dir, tmp_path / "result.json", timeout=300, extra=("--disk-dir", str(disk_dir))
    )
    # Its first request: the prompt main's engine generated last, right before its process exited.
    assert result["last"]["num_cached_tokens"] == hit(LAST_LEN) > 0
    assert_same(result["last"], main["plain_last"], exact=False, what="last prompt from disk")
    assert [r["num_cached_tokens"] for r in result["batch"]] == [hit(len(p)) for p in batch_prompts()]
    for i, (a, b) in enumerate(zip(result["batch"], main["plain_batch"], strict=True)):
        assert_same(a, b, exact=False, what=f"batch prompt {i} from disk")


# ---------------------------------------------------------------------------------------------- 6. TP=2
def test_tensor_parallel_2(main: dict[str, Any], tiny_llama_dir: Path, tmp_path: Path) -> None:
    # The default OpenMP binding refuses two workers on one NUMA node: one core each.
    result, _ = run_scenario(
        "tp2", tiny_llama_dir, tmp_path / "result.json", timeout=420, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    )
    tp2, plain = result["conn"], main["plain"]
    assert [r["num_cached_tokens"] for r in tp2["round2"]] == [hit(n) for n in PROMPT_LENS]
    for i, n in enumerate(PROMPT_LENS):
        assert_same(tp2["round1"][i], plain["round1"][i], exact=False, what=f"TP=2 vs TP=1, {n} tokens")
        assert_same(tp2["round2"][i], tp2["round1"][i], exact=True, what=f"TP=2 restored vs computed, {n}")
    assert tp2["turn2"]["num_cached_tokens"] == TURN1_LEN + TURN1_TOKENS - 1
    assert_same(tp2["turn2"], plain["turn2"], exact=False, what="TP=2 turn 2")


# ---------------------------------------------------------------------------------------------- 7. vllm serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode(errors="replace")
    return status, json.loads(raw) if raw else None


@contextlib.contextmanager
def _server(model: Path, log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--skip-tokenizer-init", "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
        "--enforce-eager", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
        "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
        "--kv-transfer-config", KV_TRANSFER_JSON,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "VLLM_SERVER_DEV_MODE": "1",
    }  # dev mode: /reset_prefix_cache
    with log.open("wb") as out:
        # Its own session: the engine core and worker go with it on a kill of the group.
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # anything of its group still there
            os.killpg(proc.pid, signal.SIGKILL)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-6000:]}"
        )
        with contextlib.suppress(OSError):
            if _http(f"{url}/health", timeout=2)[0] == 200:
                return
        proc_wait = min(0.5, max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=proc_wait)  # returns at once if the server died
    pytest.fail(f"server not healthy after {limit_s} s:\n{log.read_text(errors='replace')[-6000:]}")


def test_vllm_serve_with_the_connector_flag(
    main: dict[str, Any], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    prompt = single_prompts()[0]
    body = {
        "model": str(tiny_llama_dir),
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    with _server(tiny_llama_dir, log) as (url, proc):
        _wait_healthy(url, proc, log)
        status, first = _http(f"{url}/v1/completions", body)
        assert status == 200, first
        status, reset = _http(f"{url}/reset_prefix_cache", {})
        assert status == 200, reset
        assert reset == {"success": True}
        status, second = _http(f"{url}/v1/completions", body)
        assert status == 200, second
    tokens = [r["choices"][0]["token_ids"] for r in (first, second)]
    assert tokens[0] == tokens[1] == main["plain"]["round1"][0]["token_ids"], (tokens, log.name)
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") for r in (first, second)]
    assert cached[0] == 0, cached
    assert cached[1] == hit(len(prompt)), (cached, log.read_text(errors="replace")[-3000:])
