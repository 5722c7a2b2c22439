"""TierEvents: how a tier reports its content changes to an offloader's :class:`KVEventLog`.

The offloader gives each of its tiers one :class:`TierEvents` (``BackingTier.attach_events``) when events are
on; a tier without one emits nothing and pays one ``is None`` test per operation. Every call is synchronous and
made on the loop thread, right after the change it reports, so a tier's events are in the order its contents
changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._log import BlockInfo, KVEventLog

__all__ = ["StoredInfo", "TierEvents"]

# What a stored block's event carries: (parent hash, tokens it holds, tenant tag, token ids or None).
StoredInfo = tuple[bytes | None, int, Any, Sequence[int] | None]


class TierEvents:
    """The event sink of one tier: ``stored``, ``removed`` and ``cleared`` go to ``log`` under ``tier``
    (a unique name) and ``medium`` (``"CPU"``, ``"DISK"``, ``"REMOTE"``).

    ``resolve(key)`` supplies the metadata of a block stored without any (a lower tier writes payloads by
    hash only): the offloader answers from the CPU tier's record of the block, which is still there while the
    block is written through. Unresolved blocks are reported as full blocks with no parent and no tenant.
    """

    __slots__ = ("block_size", "log", "medium", "resolve", "tier")

    def __init__(
        self,
        log: KVEventLog,
        tier: str,
        medium: str,
        block_size: int,
        resolve: Callable[[bytes], BlockInfo | None] | None = None,
    ) -> None:
        self.log = log
        self.tier = tier
        self.medium = medium
        self.block_size = block_size
        self.resolve = resolve
        log.declare_tier(tier, medium)

    def stored(self, keys: Sequence[bytes], infos: Sequence[StoredInfo] | None = None) -> None:
        """``keys`` are stored now (committed: visible to lookups). Consecutive keys that form a chain with
        one tenant become one stored event; ``infos[i]`` describes ``keys[i]`` (resolved when ``None``)."""
        if not keys:
            return
        if len(keys) == 1:  # the common case while decoding: one block of a request per loop tick
            parent, count, ten, toks = self._resolved(keys[0]) if infos is None else infos[0]
            self.log.stored(
                self.tier,
                self.medium,
                keys,
                parent,
                self.block_size,
                token_counts=(count,),
                token_ids=toks,
                tenant=ten,
            )
            return
        if infos is None:
            infos = [self._resolved(k) for k in keys]
        log = self.log
        tier, medium, bs = self.tier, self.medium, self.block_size
        run: list[bytes] = []
        counts: list[int] = []
        tokens: list[int] | None = []
        first_parent: bytes | None = None
        tenant: Any = None
        for key, (parent, count, ten, toks) in zip(keys, infos, strict=True):
            if run and (parent != run[-1] or ten != tenant):
                log.stored(
                    tier, medium, run, first_parent, bs, token_counts=counts, token_ids=tokens, tenant=tenant
                )
                run, counts, tokens = [], [], []
            if not run:
                first_parent, tenant = parent, ten
            run.append(key)
            counts.append(count)
            if tokens is not None:
                if toks is None:
                    tokens = None
                else:
                    tokens.extend(toks)
        log.stored(tier, medium, run, first_parent, bs, token_counts=counts, token_ids=tokens, tenant=tenant)

    def _resolved(self, key: bytes) -> StoredInfo:
        info = self.resolve(key) if self.resolve is not None else None
        if info is None:
            return (None, self.block_size, None, None)
        return (info.parent_hash, info.token_count, info.tenant, None)

    def removed(self, keys: Sequence[bytes]) -> None:
        """``keys`` left the tier (evicted, found corrupt, found gone). Keys the log never saw stored are
        ignored, so a removal never precedes its block's stored event."""
        if keys:
            self.log.removed(self.tier, self.medium, keys)

    def cleared(self) -> None:
        """The tier holds nothing any more."""
        self.log.cleared(self.tier, self.medium)

    def holds(self, key: bytes) -> bool:
        """Whether the log has ``key`` stored in this tier (what consumers believe)."""
        return self.log.block(self.tier, key) is not None

    def __repr__(self) -> str:
        return f"<TierEvents {self.tier} ({self.medium})>"
