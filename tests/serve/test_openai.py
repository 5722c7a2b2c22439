"""The official openai client (sync and async, streaming and not) and httpx against a real uvicorn."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest

from ._server import ServerThread

SYSTEM = "You are a helpful assistant who answers questions about key-value caches. " * 6  # ~450 tokens


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _aclient(server: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(offload_server: ServerThread) -> None:
    with _client(offload_server) as client:
        (model,) = client.models.list().data
        assert model.id == "aiokv-tiny"
        assert client.models.retrieve("aiokv-tiny").id == "aiokv-tiny"
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.models.retrieve("gpt-4")


def test_sync_chat_and_completion_report_usage(offload_server: ServerThread) -> None:
    with _client(offload_server) as client:
        chat = client.chat.completions.create(
            model="aiokv-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
        )
        assert chat.object == "chat.completion"
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage is not None
        assert chat.usage.completion_tokens <= 5
        # ChatML: <|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n
        assert chat.usage.prompt_tokens == 1 + 5 + 5 + 2 + 1 + 9 + 1
        assert chat.usage.prompt_tokens_details is not None
        assert chat.usage.prompt_tokens_details.cached_tokens == 0
        done = client.completions.create(
            model="aiokv-tiny", prompt=["abc", "defg"], max_tokens=3, n=2, temperature=0
        )
        assert [c.index for c in done.choices] == [0, 1, 2, 3]
        assert done.usage is not None
        assert done.usage.prompt_tokens == 3 + 4
        assert 4 <= done.usage.completion_tokens <= 12
        assert done.choices[0].text == done.choices[1].text  # greedy: n copies agree


def test_sync_stream_ends_with_usage(offload_server: ServerThread) -> None:
    with _client(offload_server) as client:
        stream = client.chat.completions.create(
            model="aiokv-tiny",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens <= 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with _client(offload_server) as client:
        same = client.chat.completions.create(
            model="aiokv-tiny",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
        )
    assert same.choices[0].message.content == text


def test_raw_sse_ends_with_done(offload_server: ServerThread) -> None:
    body = {"prompt": "stream me", "max_tokens": 4, "stream": True, "temperature": 0}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", offload_server.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert {c["object"] for c in chunks} == {"text_completion"}


@pytest.mark.asyncio
async def test_async_client_streaming_and_not(offload_server: ServerThread) -> None:
    async with _aclient(offload_server) as client:
        full = await client.completions.create(
            model="aiokv-tiny", prompt="The cache", max_tokens=8, temperature=0
        )
        stream = await client.completions.create(
            model="aiokv-tiny", prompt="The cache", max_tokens=8, temperature=0, stream=True
        )
        parts = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(parts) == full.choices[0].text


def _conversation(client: openai.OpenAI, turns: int, server: ServerThread) -> tuple[list[str], list[int]]:
    messages = [{"role": "system", "content": SYSTEM}]
    texts, cached = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}: how are blocks reused?"})
        out = client.chat.completions.create(
            model="aiokv-tiny", messages=messages, max_tokens=12, temperature=0
        )  # type: ignore[arg-type]
        text = out.choices[0].message.content or ""
        assert out.usage is not None
        assert out.usage.prompt_tokens_details is not None
        cached.append(out.usage.prompt_tokens_details.cached_tokens or 0)
        texts.append(text)
        messages.append({"role": "assistant", "content": text})
        server.engine_idle_stats()  # the turn's stores are complete before the next turn looks up
    return texts, cached


def test_same_text_with_and_without_offloading(
    offload_server: ServerThread, plain_server: ServerThread
) -> None:
    with _client(offload_server) as a, _client(plain_server) as b:
        offloaded, cached = _conversation(a, 3, offload_server)
        recomputed, no_cache = _conversation(b, 3, plain_server)
    assert offloaded == recomputed
    assert no_cache == [0, 0, 0]
    assert cached[1] > 0
    assert cached[2] > cached[1]  # the whole previous turn is restored too


@pytest.mark.asyncio
async def test_concurrent_streams_sharing_a_system_prompt_report_cached_tokens(
    offload_server: ServerThread,
) -> None:
    system = "Shared instructions for every session: answer in one line, cite the block. " * 8
    async with _aclient(offload_server) as client:
        await client.chat.completions.create(
            model="aiokv-tiny", messages=[{"role": "system", "content": system}], max_tokens=1
        )
        offload_server.engine_idle_stats()  # the warm-up's stores are complete before the sessions look up
        cached: dict[int, int] = {}

        async def session(i: int) -> None:
            stream = await client.chat.completions.create(
                model="aiokv-tiny",
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"user {i} asks"},
                ],
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    assert chunk.usage.prompt_tokens_details is not None
                    cached[i] = chunk.usage.prompt_tokens_details.cached_tokens or 0

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(session, i)
    system_tokens = len(system.encode()) + 9  # <|im_start|>system\n ... <|im_end|>
    assert len(cached) == 6
    assert all(c >= (system_tokens // 16) * 16 - 16 for c in cached.values()), cached
    stats = offload_server.engine_idle_stats()
    assert stats.free_blocks == stats.num_blocks


def test_client_errors_are_openai_errors(offload_server: ServerThread) -> None:
    with _client(offload_server) as client:
        with pytest.raises(openai.NotFoundError) as nf:
            client.completions.create(model="gpt-4", prompt="x")
        assert nf.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError, match="maximum context length is 4096") as bad:
            client.completions.create(model="aiokv-tiny", prompt="x", max_tokens=9000)
        assert bad.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError, match="prompt has 5000 tokens"):
            client.completions.create(model="aiokv-tiny", prompt="y" * 5000)
        with pytest.raises(openai.BadRequestError, match="top_p is not supported"):
            client.completions.create(model="aiokv-tiny", prompt="x", top_p=0.3)
    with httpx.Client(base_url=offload_server.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400
        assert "must be valid JSON" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages"
        r = http.get("/v1/nothing")
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
