"""A persistent, crash-consistent disk tier: fixed-size entries in preallocated segment files.

Layout of the directory (guarded by ``flock`` on ``aiokv-disk.lock``: exclusive for one owner, shared by the
processes of ``shared=True`` tiers)::

    aiokv-disk.lock     lock file (holds the exclusive owner's pid, for humans)
    aiokv-disk.json     layout: format version, fingerprint, payload_bytes, entry_bytes, slots_per_segment
    aiokv-disk.idx      shared=True only: the catalog every process maps (see :mod:`aiokv.tiers._catalog`)
    seg-00000.akv ...   segment files of ``slots_per_segment`` fixed-size entries each

Every entry occupies ``entry_bytes = round_up(128 + payload_bytes, 4096)`` bytes: the 128-byte header of
:mod:`aiokv.tiers._format` followed by the payload (and zero padding). A slot of the :class:`BlockIndex` is
therefore a file offset, eviction is pure bookkeeping, and a batch of blocks stored together lands in
consecutive slots and is written with one ``pwritev`` (read back with one ``preadv`` straight into the CPU
slots: no intermediate copies).

Consistency rules:

- An entry is written (header then payload, in one call) *before* it becomes visible in the index; a crash
  mid-write leaves a header whose payload checksum does not match, and the entry is dropped when read.
- On open the index is rebuilt by scanning the headers of every slot (only headers: payloads are verified on
  every read). Entries of another layout, with a bad header or cut short by a truncated file are dropped.
  Entries are re-inserted in write order (the header's sequence number), so eviction after a restart starts
  with the oldest writes.
- Evicting an entry only forgets it in memory: until its slot is reused, a restart may bring the (valid)
  entry back. A corrupt entry is erased on disk (its header is zeroed) when a read detects it.
- Reopening a directory written with a different layout (fingerprint, payload size or segment geometry)
  *starts fresh*: the old segment files are deleted. A different ``capacity_bytes`` with the same layout keeps
  every entry whose slot still exists.
- Nothing is fsynced unless ``fsync=True``: entries survive a process crash (they are in the page cache);
  after a power loss the checksums drop whatever did not reach the disk intact.

Failures never escape: a write that fails (ENOSPC, EIO, EFBIG...) is dropped and counted, a read that fails or
does not verify is a miss (the entry is dropped), and the tier's health goes ``"degraded"`` until the next
successful I/O. A filesystem out of space (ENOSPC, EDQUOT, EFBIG) at ``open()`` does not fail the open either:
the tier starts ``"degraded"`` (sparse segment files, stores fail until space is freed) or, when not even the
directory, lock or segment files can be created, ``"down"`` (lookups miss, stores are dropped; a store after a
backoff retries the set-up). Disk I/O runs on a small private thread pool, never on the event loop.

Many processes, one directory (``shared=True``): the processes map a shared catalog instead of each keeping
its own index, so an entry stored by one is found by the others as soon as it is complete. Placement is
set-associative and eviction picks the least recently used entry of a block's set; capacity is the segment
files, whoever writes. Changes take a file lock for microseconds; reads take none and rely on verification:
an entry that changes under a read fails it and is a miss (``raced``), never wrong bytes. A writer killed
mid-store leaves reserved slots that the next writer needing room reclaims.

The package: :mod:`._geometry` (entry size, slots per segment, runs of slots), :mod:`._files` (the segment
and layout files, vectored I/O, the header scan), :mod:`._setup` (setting a directory up, at open and on
retries), :mod:`._tier` (:class:`DiskTier`, :class:`DiskTierStats`, health and retries).
"""

from __future__ import annotations

from ._tier import DiskTier, DiskTierStats

__all__ = ["DiskTier", "DiskTierStats"]
