"""Per-group block tables from vLLM's scheduler side, for the connector with several KV-cache groups (vLLM's hybrid
KV-cache manager on, :class:`~aiokv.vllm.AiokvConnector` being ``SupportsHMA``).

With the hybrid manager on, vLLM gives a connector block ids per group, in ``kv_cache_config.kv_cache_groups``
order: ``KVCacheBlocks.blocks`` (one sequence of blocks per group) in ``update_state_after_alloc``,
``NewRequestData.block_ids`` and ``CachedRequestData.new_block_ids`` (a tuple with one list per group, or ``None``)
in each ``SchedulerOutput``, and a tuple of lists in ``request_finished_all_groups``. A sliding-window group holds
vLLM's null block (block id 0, ``KVCacheBlock.is_null``) at the positions left of its window; here those are
:data:`aiokv.NO_BLOCK` (-1), aiokv's "no engine block held there".

vLLM frees a sliding-window group's blocks as they leave the window, at the start of a later step, and never says
so in the scheduler output: a table kept from the output alone still names the freed block. It can even be given
to the same request again further on. :class:`GroupBlockTables` therefore treats every block id newly allocated in
a step (to any request and group, for its forward or for a connector load) as gone from the positions of
sliding-window groups that held it before (as vLLM's offloading connector does) and reports those blocks, so that a
store still reading one is fenced before the step's forward (or load) writes it. At the end of a request,
:meth:`GroupBlockTables.finished` compares the table with the one vLLM hands over (which has the blocks it freed
at the end nulled).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import NO_BLOCK

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = [
    "GroupBlockTables",
    "GroupStep",
    "VllmGroup",
    "block_ids_of",
    "from_vllm_ids",
    "vllm_groups",
]

_NULL_BLOCK_ID = 0  # vLLM's null block: the first block of the pool (vllm/v1/core/block_pool.py)

GroupIds = tuple[list[int], ...]


@dataclass(frozen=True, slots=True)
class VllmGroup:
    """One of vLLM's KV-cache groups as aiokv stores it: its kind (``"full"``, ``"latent"``,
    ``"sliding_window"``), window (tokens, sliding-window groups only), block size and layers."""

    index: int
    kind: str
    window: int | None
    block_size: int
    layer_names: tuple[str, ...]


_SUPPORTED = "FullAttentionSpec, MLAAttentionSpec and SlidingWindowSpec"


def vllm_groups(kv_cache_config: Any) -> tuple[VllmGroup, ...] | None:
    """The groups of vLLM's ``KVCacheConfig`` for a grouped aiokv layout, or ``None`` for the one-group path
    (one group of full attention, MLA included: every block held until the request ends, as with vLLM's
    hybrid manager off). Any group of another kind (Mamba state, chunked local attention, ...) is refused,
    naming the group, its spec and its layers."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    from .._errors import InvalidArgumentError

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) == 1 and isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        return None
    out: list[VllmGroup] = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        names = tuple(g.layer_names)
        kind = {
            FullAttentionSpec: "full",
            MLAAttentionSpec: "latent",
            SlidingWindowSpec: "sliding_window",
        }.get(type(spec))
        if kind is None:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise InvalidArgumentError(
                f"kv_cache_groups[{i}] ({type(spec).__name__}, layers {shown}) is not supported by AiokvConnector: "
                f"it stores {_SUPPORTED} groups"
            )
        window = int(spec.sliding_window) if kind == "sliding_window" else None
        out.append(VllmGroup(i, kind, window, int(spec.block_size), names))
    if not out:
        raise InvalidArgumentError("kv_cache_config must have at least one KV-cache group, got none")
    sizes = sorted({g.block_size for g in out})
    if len(sizes) > 1:
        raise InvalidArgumentError(
            f"kv_cache_groups must share one block size for AiokvConnector, got block sizes {sizes}"
        )
    return tuple(out)


def block_ids_of(blocks: KVCacheBlocks) -> GroupIds:
    """The block ids per group of vLLM's ``KVCacheBlocks``, null blocks as ``NO_BLOCK``."""
    return tuple([NO_BLOCK if b.is_null else int(b.block_id) for b in group] for group in blocks.blocks)


def from_vllm_ids(ids: Sequence[Sequence[int]] | None, num_groups: int) -> GroupIds:
    """vLLM's block ids per group (``SchedulerOutput``, ``request_finished_all_groups``), the null block (id 0) as
    ``NO_BLOCK``; ``None`` (no group got a block) as empty lists."""
    if ids is None:
        return tuple([] for _ in range(num_groups))
    if len(ids) != num_groups:
        from .._errors import InvalidArgumentError

        raise InvalidArgumentError(f"block ids must have one list per group ({num_groups}), got {len(ids)}")
    return tuple([NO_BLOCK if b == _NULL_BLOCK_ID else int(b) for b in group] for group in ids)


@dataclass(frozen=True, slots=True)
class GroupStep:
    """One scheduled request's block ids in one step. ``new_block_ids``: per group, the ids appended to its table,
    or the whole table when ``full_table`` (a new request, or one resumed after a preemption)."""

    req_id: str
    new_block_ids: GroupIds
    full_table: bool


class GroupBlockTables:
    """Every running request's block table per group, kept from vLLM's scheduler outputs.

    ``sliding_groups``: the indices of the groups whose blocks vLLM frees while the request runs (sliding-window
    groups); their positions holding a block id that a step allocates again become ``NO_BLOCK``.
    """

    def __init__(self, num_groups: int, sliding_groups: Iterable[int] = (), block_size: int = 1) -> None:
        from .._errors import InvalidArgumentError

        if num_groups < 1:
            raise InvalidArgumentError(f"num_groups must be >= 1, got {num_groups}")
        sliding = tuple(sorted(set(sliding_groups)))
        if any(not 0 <= g < num_groups for g in sliding):
            raise InvalidArgumentError(
                f"sliding_groups must be group indices in [0, {num_groups}), got {sliding}"
            )
        self.num_groups = num_groups
        self.sliding_groups = sliding
        self.block_size = block_size
        self._tables: dict[str, GroupIds] = {}

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: object) -> GroupBlockTables:
        """The groups of vLLM's ``KVCacheConfig``; ``SlidingWindowSpec`` groups are the sliding ones."""
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        groups = kv_cache_config.kv_cache_groups  # type: ignore[attr-defined]
        sliding = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)]
        return cls(len(groups), sliding, int(groups[0].kv_cache_spec.block_size))

    def table(self, req_id: str) -> GroupIds | None:
        """A copy of the request's table per group (``None``: not running)."""
        t = self._tables.get(req_id)
        return None if t is None else tuple(list(g) for g in t)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._tables

    def __iter__(self) -> Iterator[str]:
        """The requests with a table."""
        return iter(list(self._tables))

    def drop(self, req_id: str) -> None:
        """Forget a request (finished, aborted, preempted). Idempotent."""
        self._tables.pop(req_id, None)

    def apply(
        self, so: SchedulerOutput, allocated: Iterable[int] = ()
    ) -> tuple[list[GroupStep], dict[str, GroupIds]]:
        """Apply one step's scheduler output. ``allocated``: block ids allocated in this step that the output does
        not show (a connector load's blocks, ``update_state_after_alloc``). Returns the scheduled requests' block
        ids, and per request (preempted ones included) the sliding-window block ids that this step allocates
        again: gone from that request, possibly written by this step's forward or a load."""
        steps: list[GroupStep] = []
        new_ids: set[int] = set(allocated)
        bs = self.block_size
        for nr in so.scheduled_new_reqs:
            ids = from_vllm_ids(nr.block_ids, self.num_groups)
            steps.append(GroupStep(nr.req_id, ids, True))
            # Positions before num_computed_tokens are prefix-cache hits (not written) or a load's blocks
            # (passed in ``allocated`` the step they were allocated).
            first = int(nr.num_computed_tokens) // bs
            new_ids.update(b for group in ids for b in group[first:] if b != NO_BLOCK)
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            ids = from_vllm_ids(cached.new_block_ids[i], self.num_groups)
            full = rid in resumed or rid not in self._tables
            steps.append(GroupStep(rid, ids, full))
            first = int(cached.num_computed_tokens[i]) // bs if rid in resumed else 0
            new_ids.update(b for group in ids for b in group[first:] if b != NO_BLOCK)
        for copy in getattr(so, "kv_cache_block_copies", None) or ():
            new_ids.add(int(copy.dst_block_id))
        released = self._release(new_ids) if self.sliding_groups and new_ids else {}
        for rid in so.preempted_req_ids or ():
            self.drop(rid)
        for rid in so.finished_req_ids:
            self.drop(rid)
        for step in steps:
            old = None if step.full_table else self._tables.get(step.req_id)
            if old is None:
                self._tables[step.req_id] = tuple(list(g) for g in step.new_block_ids)
            else:
                for table, new in zip(old, step.new_block_ids, strict=True):
                    table.extend(new)
        return steps, released

    def finished(self, req_id: str, vllm_ids: GroupIds) -> GroupIds:
        """The request ended (``request_finished_all_groups``, ``vllm_ids`` in aiokv's form): forget it and return
        the sliding-window blocks vLLM freed that its table still names (vLLM frees the blocks out of the window
        right before the call, and nulls them in the table it hands over)."""
        table = self._tables.pop(req_id, None)
        gone: list[list[int]] = [[] for _ in range(self.num_groups)]
        if table is None:
            return tuple(gone)
        for g in self.sliding_groups:
            theirs = vllm_ids[g] if g < len(vllm_ids) else []
            for pos, b in enumerate(table[g]):
                # Positions past the table vLLM hands over (clipped to the computed tokens) are still held.
                if b != NO_BLOCK and pos < len(theirs) and theirs[pos] != b:
                    gone[g].append(b)
        return tuple(gone)

    def _release(self, allocated: set[int]) -> dict[str, GroupIds]:
        """Block ids of the tables as they were before this step's appends that are allocated now."""
        released: dict[str, GroupIds] = {}
        for rid, table in self._tables.items():
            gone: list[list[int]] = [[] for _ in range(self.num_groups)]
            for g in self.sliding_groups:
                ids = table[g]
                for pos, b in enumerate(ids):
                    if b in allocated:
                        ids[pos] = NO_BLOCK
                        gone[g].append(b)
            if any(gone):
                released[rid] = tuple(gone)
        return released
