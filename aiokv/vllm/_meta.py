"""What the scheduler-side connector tells the workers each step, and what they answer.

Plain picklable records: vLLM ships the scheduler's metadata to every worker (over shared memory with a
multiprocess executor) and aggregates the workers' answers before the scheduler sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

__all__ = [
    "AiokvConnectorMetadata",
    "AiokvWorkerMetadata",
    "DropJob",
    "EndJob",
    "LoadJob",
    "LookupJob",
    "StepJob",
]


@dataclass(slots=True)
class LookupJob:
    """Open (or re-admit) a request and look its prefix up. ``seq`` tells this lookup's answer from an older
    one's (a request preempted and admitted again asks again)."""

    req_id: str
    seq: int
    new_tokens: list[int]  # tokens the worker has not been sent yet (the whole prompt the first time)
    salt: str | None
    extra_keys: tuple[object, ...]


# One list of block ids (one KV-cache group), or one list per group (vLLM's hybrid KV-cache manager; aiokv's
# NO_BLOCK where vLLM holds its null block).
BlockIds = list[int] | tuple[list[int], ...]


@dataclass(slots=True)
class LoadJob:
    """Restore the looked-up prefix into ``block_ids`` (the request's first blocks); the first
    ``present_blocks`` of them hold vLLM's own prefix-cache hit and are not written."""

    req_id: str
    block_ids: BlockIds
    present_blocks: int


@dataclass(slots=True)
class StepJob:
    """One scheduled request's step, applied after the forward: its new blocks and tokens, and how many of
    its tokens have their KV written once this step's forward ran."""

    req_id: str
    new_tokens: list[int]
    new_blocks: BlockIds
    num_computed_tokens: int
    full_table: bool = False  # new_blocks is the whole table of a new admission (not an append)


@dataclass(slots=True)
class EndJob:
    """A request left the engine (``kind``: ``"finish"``, ``"abort"``) or was preempted (``"preempt"``).
    ``report``: vLLM keeps its blocks until the worker names it in ``finished_sending``. ``drops`` (several
    groups): sliding-window blocks vLLM freed already (at the end, or reallocated this step), per group."""

    req_id: str
    kind: str
    new_tokens: list[int]
    num_computed_tokens: int
    report: bool
    drops: tuple[list[int], ...] | None = None


@dataclass(slots=True)
class DropJob:
    """Several groups: vLLM freed these sliding-window blocks of a running request (per group) and reallocated
    them this step; the worker tells aiokv and waits for every copy that may still read them before the
    forward."""

    req_id: str
    block_ids: tuple[list[int], ...]


@dataclass
class AiokvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one per engine step."""

    lookups: list[LookupJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    drops: list[DropJob] = field(default_factory=list)
    steps: list[StepJob] = field(default_factory=list)
    preempted: list[EndJob] = field(default_factory=list)
    ended: list[EndJob] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0  # of which tokens of a prompt (the planner's prefill-rate sample)


@dataclass
class AiokvWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: lookup answers, ``(req_id, seq) -> (workers that answered, fewest tokens)``.
    Aggregated over the workers of one step; the scheduler waits until every worker has answered."""

    lookups: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, AiokvWorkerMetadata)
        merged = dict(self.lookups)
        for key, (count, tokens) in other.lookups.items():
            have = merged.get(key)
            merged[key] = (count, tokens) if have is None else (have[0] + count, min(have[1], tokens))
        return AiokvWorkerMetadata(lookups=merged)
