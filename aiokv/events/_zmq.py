"""Publish an offloader's KV events in vLLM's KV-events wire format, so existing KV-aware routers (llm-d,
Dynamo, Mooncake's) can consume aiokv's tiers as they consume vLLM's.

Wire format (vLLM ``vllm.distributed.kv_events``): a PUB socket sends multipart messages
``[topic, seq (8 bytes, big endian), payload]``, where ``payload`` is a msgpack array ``[ts, [event, ...]]``
(``[ts, [event, ...], data_parallel_rank]`` when a rank is given) and each event is a tagged array:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

Block hashes are aiokv's 32-byte hashes (msgpack bin). One message carries the events of one loop tick.
A ROUTER replay socket answers a request carrying a start sequence number (8 bytes, big endian) with every
buffered message from there (``[seq, payload]`` frames), then an end marker ``[-1, b""]``. A consumer that
asks for messages older than the buffer gets one message with the full current state instead: an
``AllBlocksCleared`` followed by ``BlockStored`` events for every block of every tier (vLLM has no snapshot
for late joiners; this is how aiokv's routers resynchronize), numbered with the last published sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

from .._errors import InvalidArgumentError, MissingDependencyError
from ._log import EventKind, KVEvent, KVEventLog, KVEventStream, KVSnapshot

__all__ = ["ZmqEventPublisher", "encode_batch"]

_END = (-1).to_bytes(8, "big", signed=True)


def _encode_event(ev: KVEvent) -> list[Any]:
    if ev.kind is EventKind.STORED:
        tokens = list(ev.token_ids) if ev.token_ids is not None else []
        return ["BlockStored", list(ev.block_hashes), ev.parent_hash, tokens, ev.block_size, None, ev.medium]
    if ev.kind is EventKind.REMOVED:
        return ["BlockRemoved", list(ev.block_hashes), ev.medium]
    return ["AllBlocksCleared"]


def encode_batch(events: list[list[Any]], *, ts: float, rank: int | None = None) -> bytes:
    """msgpack bytes of one vLLM ``KVEventBatch`` holding already encoded ``events``."""
    import msgpack

    body: list[Any] = [ts, events] if rank is None else [ts, events, rank]
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def _snapshot_events(snap: KVSnapshot) -> list[list[Any]]:
    out: list[list[Any]] = [["AllBlocksCleared"]]
    for tier, blocks in snap.tiers.items():
        medium = snap.media.get(tier, tier.upper())
        for key, info in blocks.items():
            out.append(["BlockStored", [key], info.parent_hash, [], info.token_count, None, medium])
    return out


class ZmqEventPublisher:
    """Publishes ``log`` on ``endpoint`` (PUB) with a replay service on ``replay_endpoint`` (ROUTER).

    Use as ``async with ZmqEventPublisher(off.event_log, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"):``
    ``buffer`` messages are kept for replay (vLLM's default is 10,000). Needs ``aiokv[events]`` (pyzmq,
    msgpack)."""

    def __init__(
        self,
        log: KVEventLog,
        endpoint: str = "tcp://127.0.0.1:5557",
        replay_endpoint: str | None = "tcp://127.0.0.1:5558",
        *,
        topic: str = "kv-events",
        buffer: int = 10_000,
        data_parallel_rank: int | None = None,
    ) -> None:
        try:
            import msgpack  # noqa: F401
            import zmq
            import zmq.asyncio
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise MissingDependencyError(
                "ZmqEventPublisher needs pyzmq and msgpack: pip install 'aiokv[events]'"
            ) from exc
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise InvalidArgumentError(f"buffer must be an int >= 1, got {buffer!r}")
        self._log = log
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise InvalidArgumentError(
                f"cannot bind the event sockets ({endpoint}, {replay_endpoint}): {exc}"
            ) from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._router.getsockopt_string(zmq.LAST_ENDPOINT) if self._router is not None else None
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._seq = 0
        self.published_events = 0
        self.event_seq = log.seq  # the last log event published
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> ZmqEventPublisher:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self) -> None:
        """Publish every event emitted from now on."""
        loop = asyncio.get_running_loop()
        stream = self._log.subscribe(from_seq=self._log.seq)  # now, not when the task first runs
        self._tasks.append(loop.create_task(self._publish(stream), name="aiokv-events-publish"))
        if self._router is not None:
            self._tasks.append(loop.create_task(self._serve_replay(), name="aiokv-events-replay"))

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()

    @property
    def seq(self) -> int:
        """The sequence number of the last message published."""
        return self._seq

    async def wait_published(self, event_seq: int | None = None) -> None:
        """Wait until the log's events up to ``event_seq`` (default: all so far) are published."""
        target = self._log.seq if event_seq is None else event_seq
        while self.event_seq < target:
            self._progress.clear()
            await self._progress.wait()

    # ------------------------------------------------------------------ publishing
    async def _publish(self, stream: KVEventStream) -> None:
        batch: list[list[Any]] = []
        async for item in stream:
            if isinstance(item, KVSnapshot):  # fell behind the log's buffer: resynchronize every consumer
                batch = _snapshot_events(item)
            else:
                batch.append(_encode_event(item))
            # Everything already available joins this message: one message per loop tick.
            more = stream.drain_nowait()
            if more is not None:
                batch.extend(_encode_event(ev) for ev in more)
            await self._send(batch)
            batch = []
            self.event_seq = stream.cursor if stream.cursor is not None else self.event_seq
            self._progress.set()

    async def _send(self, events: list[list[Any]]) -> None:
        self._seq += 1
        payload = encode_batch(events, ts=time.time(), rank=self._rank)
        self._buffer.append((self._seq, payload))
        self.published_events += len(events)
        await self._pub.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            frames = await router.recv_multipart()
            identity, start_bytes = frames[0], frames[-1]
            start = int.from_bytes(start_bytes, "big", signed=True)
            buffered = self._buffer
            if buffered and start < buffered[0][0] and start <= self._seq:
                # Older than the buffer: the full state, numbered as the last message it includes.
                payload = encode_batch(
                    _snapshot_events(self._log.snapshot()), ts=time.time(), rank=self._rank
                )
                await router.send_multipart([identity, b"", self._seq.to_bytes(8, "big"), payload])
            else:
                for seq, payload in list(buffered):
                    if seq >= start:
                        await router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            await router.send_multipart([identity, b"", _END, b""])
