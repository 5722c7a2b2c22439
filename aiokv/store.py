"""The store core: the CPU tier's index behind a synchronous, two-phase protocol.

Every decision about which block lives where is made here, on one thread, without awaiting: reservations and
eviction, deduplication, pins, commit and discard, tenants' quotas, priorities, and the KV events these changes
produce. Copies are somebody else's work: a caller *prepares* an operation (gets a plan naming the blocks, their
CPU slots and their keys), has the copy done by whatever executes transfers (aiokv's
:class:`~aiokv.transfer.TransferExecutor`, a test's fake, another engine's worker), then *completes* it::

    plan = store.prepare_store(chain, 0, len(chain), tenant=None, priority=0)
    # copy engine blocks [ids[i] for i in plan.positions] into CPU slots plan.slots ...
    store.complete_store(plan.keys, success=True)   # visible to lookups from now on

    slots = store.prepare_load(chain)                # pins the leading cached blocks
    # copy CPU slots -> engine blocks ...
    store.complete_load(chain[: len(slots)])         # unpinned: evictable again

The shape is that of vLLM's offloading manager (``prepare_store``/``complete_store``,
``prepare_load``/``complete_load``, ``lookup``, ``touch``): a block is invisible to lookups from its
reservation until its copy completed (``PENDING``), and cannot be evicted while a load reads it (pinned), so
no copy can ever read or overwrite a slot another block owns. :class:`aiokv.Offloader` is built on it (its data
path, the staging of lower tiers and the write-through go through these methods only), and so can any engine
that runs its own copies.

Misuse is an error, never a silent acceptance: completing a key that is not a pending reservation, or
unpinning one that is not pinned, raises :class:`~aiokv.RequestStateError` naming the key and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ._errors import InvalidArgumentError, InvalidTypeError, RequestStateError
from .tiers._index import BlockIndex, EntryState
from .tiers._policies import EvictionPolicy, make_policy

__all__ = ["BlockStore", "BlockStoreStats", "EntryState", "StoreEventSink", "StorePlan"]

# Per reserved key, while events are recorded: (parent key or None, tokens, origin, token offset).
_Meta = tuple["bytes | None", int, Any, int]


class StoreEventSink(Protocol):
    """Where a :class:`BlockStore` reports its changes (``aiokv.events`` provides one per tier)."""

    def stored(self, keys: Sequence[bytes], infos: Sequence[Any] | None = None) -> None:
        """``keys`` became visible; ``infos[i]`` = ``(parent, num_tokens, salt, token_ids)`` of ``keys[i]``."""

    def removed(self, keys: Sequence[bytes]) -> None:
        """``keys`` left the store (evicted)."""


class StorePlan(NamedTuple):
    """What :meth:`BlockStore.prepare_store` reserved: copy chain positions ``positions`` into CPU
    ``slots`` (one per key of ``keys``), then hand ``keys`` to :meth:`BlockStore.complete_store`."""

    keys: list[bytes]
    """The keys reserved, in chain order (PENDING until completed)."""
    slots: list[int]
    """Their CPU slots."""
    positions: list[int]
    """Their positions in the chain."""
    deduplicated: int
    """Blocks already present (touched, not copied again)."""
    dropped: int
    """Blocks that found no room (every slot pending or pinned, or the tenant at its quota)."""


@dataclass(frozen=True, slots=True)
class BlockStoreStats:
    """Counts since the store was made."""

    entries: int
    """Keys held, pending or ready."""
    pending: int
    """Reservations not yet completed."""
    free_slots: int
    deduplicated: int
    """Store decisions that found the block already present."""
    dropped: int
    """Store decisions that found no room."""
    committed: int
    """Keys completed successfully (stored or staged)."""
    discarded: int
    """Reservations completed unsuccessfully (their slots are free again)."""
    evictions: int


class BlockStore:
    """The CPU tier's blocks: ``num_slots`` slots, keyed by chained block hashes (``bytes``).

    Make one with ``BlockStore(num_slots, block_size=16, eviction="lru")``, or over an existing index with
    :meth:`over` (what :class:`~aiokv.Offloader` does with its :class:`~aiokv.CPUTier`'s). Not thread-safe:
    call it from one thread (the offloader's loop thread).

    ``origin`` arguments name who stores a block, for the KV events: an object with ``salt`` and
    ``token_ids`` (a :class:`~aiokv.Request`), or ``None``.
    """

    __slots__ = (
        "_committed",
        "_deduplicated",
        "_discarded",
        "_dropped",
        "_events",
        "_meta",
        "block_size",
        "index",
    )

    def __init__(
        self,
        num_slots: int,
        *,
        block_size: int,
        eviction: str | EvictionPolicy | Callable[[int], EvictionPolicy] = "lru",
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int):
            raise InvalidTypeError(f"num_slots must be an int, got {type(num_slots).__name__}")
        if num_slots <= 0:
            raise InvalidArgumentError(f"num_slots must be > 0, got {num_slots}")
        self._setup(BlockIndex(num_slots, make_policy(eviction, num_slots)), block_size)

    @classmethod
    def over(cls, index: BlockIndex, *, block_size: int) -> BlockStore:
        """A store deciding for ``index`` (shared, not copied: a :class:`~aiokv.CPUTier`'s)."""
        if not isinstance(index, BlockIndex):
            raise InvalidTypeError(f"index must be a BlockIndex, got {type(index).__name__}")
        self = cls.__new__(cls)
        self._setup(index, block_size)
        return self

    def _setup(self, index: BlockIndex, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be an int > 0, got {block_size!r}")
        self.index = index
        self.block_size = block_size
        self._events: StoreEventSink | None = None
        self._meta: dict[bytes, _Meta] | None = None
        self._deduplicated = 0
        self._dropped = 0
        self._committed = 0
        self._discarded = 0

    # ------------------------------------------------------------------ events
    def record_events(self, sink: StoreEventSink) -> None:
        """Report every commit (``stored``, with its parent, tokens and tenant) and eviction (``removed``) to
        ``sink`` from now on."""
        if not (callable(getattr(sink, "stored", None)) and callable(getattr(sink, "removed", None))):
            raise InvalidTypeError(
                f"sink must have stored() and removed() methods, got {type(sink).__name__}"
            )
        self._events = sink
        self._meta = {}
        self.index.on_evict = []

    @property
    def records_events(self) -> bool:
        return self._events is not None

    def _report_evictions(self) -> None:
        evicted = self.index.on_evict
        if evicted:
            assert self._events is not None
            self._events.removed(evicted)
            evicted.clear()

    def _report_stored(self, keys: Sequence[bytes]) -> None:
        assert self._events is not None
        assert self._meta is not None
        meta = self._meta
        bs = self.block_size
        infos: list[Any] = []
        for key in keys:
            m = meta.pop(key, None)
            if m is None:
                infos.append((None, bs, None, None))
                continue
            parent, count, origin, offset = m
            if origin is None:
                infos.append((parent, count, None, None))
            else:
                infos.append((parent, count, origin.salt, origin.token_ids[offset : offset + count]))
        self._events.stored(keys, infos)

    # ----------------------------------------------------------------- queries
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are cached (READY). Changes nothing."""
        return self.index.match_prefix(keys)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` recently used (those present), as a hit would."""
        touch = self.index.touch
        for key in keys:
            touch(key)

    def state(self, key: bytes) -> EntryState | None:
        """``READY``, ``PENDING`` (reserved, its copy not completed) or ``None`` (absent)."""
        return self.index.state(key)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is READY."""
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    # --------------------------------------------------------------- stores
    def prepare_store(
        self,
        chain: Sequence[bytes],
        start: int = 0,
        end: int | None = None,
        *,
        tenant: bytes | None = None,
        priority: int = 0,
        origin: Any = None,
    ) -> StorePlan:
        """Reserve CPU slots for the blocks ``start..end-1`` of one request's ``chain`` (block ``i`` has key
        ``chain[i]``, parent ``chain[i - 1]`` and depth ``i``), evicting as needed. Blocks already present are
        touched (deduplicated), blocks that find no room are dropped; both are counted. Reserved keys are
        PENDING: invisible to lookups until :meth:`complete_store`."""
        if end is None:
            end = len(chain)
        _check_run(chain, start, end)
        _check_owner(tenant, priority)
        positions, slots, present = self.index.reserve_run(chain, start, end, tenant, priority)
        self._deduplicated += present
        self._dropped += end - start - present - len(slots)
        keys = [chain[i] for i in positions]
        meta = self._meta
        if meta is not None:
            bs = self.block_size
            for i, key in zip(positions, keys, strict=True):
                meta[key] = (chain[i - 1] if i else None, bs, origin, i * bs)
            self._report_evictions()
        return StorePlan(keys, slots, positions, present, end - start - present - len(slots))

    def prepare_store_one(
        self,
        key: bytes,
        parent: bytes | None = None,
        depth: int = 0,
        tenant: bytes | None = None,
        priority: int = 0,
        origin: Any = None,
        num_tokens: int | None = None,
    ) -> int | None:
        """:meth:`prepare_store` for one block: its slot, or ``None`` (present: touched; or no room), counted.
        ``num_tokens`` (events): the block's tokens when it is not full."""
        # Inline (a decode step's block comes through here): the checks of _check_owner, then its errors.
        if (
            type(key) is not bytes
            or (tenant is not None and type(tenant) is not bytes)
            or type(priority) is not int
            or not -128 <= priority <= 127
        ):
            if type(key) is not bytes:
                raise InvalidTypeError(f"key must be bytes (a block hash), got {type(key).__name__}")
            _check_owner(tenant, priority)
        slot = self.index.reserve(key, parent, depth, tenant, priority)
        meta = self._meta
        if meta is not None:
            if slot is not None:
                count = self.block_size if num_tokens is None else num_tokens
                # The first block's parent is the chain seed, not a block: events report none.
                meta[key] = (parent if depth else None, count, origin, depth * self.block_size)
            self._report_evictions()
        if slot is None:
            if self.index.state(key) is not None:
                self._deduplicated += 1
            else:
                self._dropped += 1
        return slot

    def prepare_fill(
        self,
        chain: Sequence[bytes],
        start: int,
        end: int,
        *,
        tenant: bytes | None = None,
        priority: int = 0,
        origin: Any = None,
    ) -> tuple[list[bytes], list[int]]:
        """Reserve slots for blocks ``start..end-1`` of ``chain`` about to be read from another tier (staging):
        the leading run that can be reserved (it stops at the first block present or without room). Not a
        store decision, so not counted. Returns the keys and slots; complete with :meth:`complete_fill`."""
        _check_run(chain, start, end)
        _check_owner(tenant, priority)
        reserve = self.index.reserve
        meta = self._meta
        bs = self.block_size
        keys: list[bytes] = []
        slots: list[int] = []
        for i in range(start, end):
            key = chain[i]
            parent = chain[i - 1] if i else None
            slot = reserve(key, parent, i, tenant, priority)
            if slot is None:
                break
            keys.append(key)
            slots.append(slot)
            if meta is not None:
                meta[key] = (parent, bs, origin, i * bs)
        if meta is not None:
            self._report_evictions()
        return keys, slots

    def _check_pending(self, keys: Sequence[bytes], what: str) -> None:
        index = self.index
        key = index.first_not_pending_or_repeated(keys)
        if key is not None:
            raise RequestStateError(
                f"{what}: key {_short(key)} is not a pending reservation of this store "
                f"({'absent' if index.state(key) is None else 'already ready'}); nothing was changed"
            )

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """End the copies of reserved ``keys``: on success they become READY (visible, evictable) and are
        reported stored; otherwise their reservations are released (the blocks are misses)."""
        self._check_pending(keys, "complete_store")
        if success:
            self.index.commit_run(keys)
            self._committed += len(keys)
            if self._events is not None:
                self._report_stored(keys)
        else:
            self._release(keys)

    def complete_fill(self, keys: Sequence[bytes], arrived: int) -> list[bytes]:
        """End a fill of ``keys`` (from :meth:`prepare_fill`) of which the first ``arrived`` were read and
        verified: those become READY and pinned (for the load that asked), the rest are released. Returns
        the pinned keys."""
        self._check_pending(keys, "complete_fill")
        if isinstance(arrived, bool) or not isinstance(arrived, int) or not 0 <= arrived <= len(keys):
            raise InvalidArgumentError(f"arrived must be an int in [0, {len(keys)}], got {arrived!r}")
        index = self.index
        self._release(keys[arrived:])
        got = keys[:arrived]
        for key in got:
            index.commit(key)
            index.pin(key)
        self._committed += arrived
        if got and self._events is not None:
            self._report_stored(got)
        return list(got)

    def _release(self, keys: Iterable[bytes]) -> None:
        discard = self.index.discard
        meta = self._meta
        n = 0
        for key in keys:
            discard(key)
            if meta is not None:
                meta.pop(key, None)
            n += 1
        self._discarded += n

    def discard(self, keys: Iterable[bytes]) -> int:
        """Remove READY, unpinned ``keys`` (e.g. found corrupt elsewhere); returns how many were present. A
        pending reservation is ended by :meth:`complete_store` (``success=False``) instead: only its owner
        knows that no copy still writes its slot. Refused whole (nothing removed) if any key is pinned or
        pending."""
        index = self.index
        keys = list(keys)
        for key in keys:
            state = index.state(key)
            if state is EntryState.PENDING:
                raise RequestStateError(
                    f"discard: key {_short(key)} is a pending reservation (end it with complete_store(keys, "
                    "success=False)); nothing was removed"
                )
            if state is not None and index.pins(key):
                raise RequestStateError(
                    f"discard: key {_short(key)} is pinned by a load; nothing was removed"
                )
        n = 0
        for key in keys:
            if index.discard(key):
                n += 1
        return n

    # ---------------------------------------------------------------- loads
    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the leading cached ``keys`` (touched, as hits) and return their slots: a load may copy them out
        until :meth:`complete_load` (eviction cannot take them meanwhile)."""
        return self.index.pin_prefix(keys)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Unpin ``keys`` (their load ended, whatever its outcome)."""
        index = self.index
        key = index.first_not_pinned(keys)
        if key is not None:
            raise RequestStateError(
                f"complete_load: key {_short(key)} is not pinned by a load; nothing was changed"
            )
        index.unpin(keys)

    def pin(self, key: bytes) -> int:
        """Pin one READY key (e.g. to copy it to another tier); its slot. Unpin with :meth:`complete_load`."""
        try:
            return self.index.pin(key)
        except KeyError:
            raise RequestStateError(f"pin: key {_short(key)} is not ready in this store") from None

    def slot(self, key: bytes) -> int:
        """The CPU slot of a present ``key`` (``KeyError`` if absent)."""
        return self.index.slot(key)

    def tenant(self, key: bytes) -> bytes | None:
        """The tenant a present ``key`` was stored for (recorded when tenants are tracked), else ``None``."""
        return self.index.tenant(key)

    def retain(self, keys: Sequence[bytes], seconds: float) -> None:
        """Ask the eviction policy to keep ``keys`` for ``seconds`` (a session's retention), when it supports
        that (the ``session`` policy); other policies ignore it."""
        retain = getattr(self.index.policy, "retain", None)
        if retain is not None:
            retain(keys, seconds)

    # ---------------------------------------------------------------- stats
    def stats(self) -> BlockStoreStats:
        s = self.index.stats()
        return BlockStoreStats(
            entries=len(self.index),
            pending=s.pending,
            free_slots=s.num_slots - s.used_slots,
            deduplicated=self._deduplicated,
            dropped=self._dropped,
            committed=self._committed,
            discarded=self._discarded,
            evictions=s.evictions,
        )

    def __repr__(self) -> str:
        return f"<BlockStore {len(self.index)}/{self.index.num_slots} slots, block_size={self.block_size}>"


def _short(key: object) -> str:
    return f"{key.hex()[:16]}..." if isinstance(key, bytes) else repr(key)


def _check_run(chain: Sequence[bytes], start: int, end: int) -> None:
    """``start..end`` must be a range of ``chain`` whose keys are bytes (block hashes)."""
    for name, value in (("start", start), ("end", end)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= start <= end <= len(chain):
        raise InvalidArgumentError(
            f"start and end must satisfy 0 <= start <= end <= {len(chain)}, got {start}, {end}"
        )
    for i in range(start, end):
        if type(chain[i]) is not bytes:
            raise InvalidTypeError(f"chain[{i}] must be bytes (a block hash), got {type(chain[i]).__name__}")


def _check_owner(tenant: object, priority: object) -> None:
    """A reservation's tenant (``bytes`` or ``None``) and priority (an int in -128..127, what the index keeps
    per slot): checked before the index changes, so a bad value never leaves a half-made entry."""
    if tenant is not None and type(tenant) is not bytes:
        raise InvalidTypeError(f"tenant must be bytes or None, got {type(tenant).__name__}")
    if type(priority) is not int:
        raise InvalidTypeError(f"priority must be an int, got {type(priority).__name__}")
    if not -128 <= priority <= 127:
        raise InvalidArgumentError(f"priority must be in [-128, 127], got {priority}")
