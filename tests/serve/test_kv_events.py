"""``aiokv serve --kv-events-endpoint``: the server's offloader publishes its KV events in vLLM's wire format;
a router asking the replay socket after a completion gets the blocks its prompt stored."""

from __future__ import annotations

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from aiokv.serve import create_app
from aiokv.serve._config import ServeConfig

from ._server import config
from .test_embed import _serve_and


def test_the_event_endpoints_are_validated_and_read_from_the_environment() -> None:
    cfg = ServeConfig.from_sources(
        {}, {"AIOKV_KV_EVENTS_ENDPOINT": "tcp://*:5557", "AIOKV_KV_EVENTS_REPLAY_ENDPOINT": "tcp://*:5558"}
    )
    assert (cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        ServeConfig(kv_events_replay_endpoint="tcp://*:5558")
    with pytest.raises(ValueError, match=r"kv_events_endpoint needs offloading \(drop --no-offload\)"):
        ServeConfig(kv_events_endpoint="tcp://*:5557", offload=False)
    with pytest.raises(ValueError, match="kv_events_endpoint must not be empty"):
        ServeConfig(kv_events_endpoint="")


@pytest.mark.asyncio
async def test_a_served_completion_publishes_its_stored_blocks() -> None:
    app = create_app(
        config(kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*")
    )
    events: list[list[object]] = []

    async def check(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/v1/completions", json={"prompt": "a" * 80, "max_tokens": 2})
            assert r.status_code == 200
        service = app.state.service
        await service.engine.wait_idle()  # the request's blocks are stored (its finish resolved)
        off = service.offloader
        await off.executor.drain()
        pub = off.kv_events_publisher
        assert pub is not None
        assert pub.replay_endpoint is not None
        await pub.wait_published()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(pub.replay_endpoint)
            await sock.send_multipart([b"", (1).to_bytes(8, "big")])
            while True:
                _empty, _seq, payload = await sock.recv_multipart()
                if not payload:
                    break
                events.extend(msgpack.unpackb(payload, raw=False)[1])
        finally:
            sock.close(0)
            ctx.term()
        stored = {h for ev in events if ev[0] == "BlockStored" for h in ev[1]}
        assert stored
        assert stored <= set(off.cpu.index.ready_keys()) | {
            h for ev in events if ev[0] == "BlockRemoved" for h in ev[1]
        }
        assert all(ev[6] == "CPU" for ev in events if ev[0] == "BlockStored")

    await _serve_and(app, check)
