"""A shared Redis / Valkey tier (single node or Redis Cluster) with bounded timeouts and a circuit breaker.

Each block is one string value: the 128-byte header of :mod:`aiokv.tiers._format` followed by the payload,
under the key ``{namespace}:{fingerprint[:8].hex()}:{block_hash.hex()}``. A block larger than one value may be
(the server's ``proto-max-bulk-len``, read at open, or ``max_value_bytes``) is split into parts of at most
that size, under ``{key}:{part_bytes}:{j}``: processes configured with another part size use other keys, so
they never read, count or delete each other's parts. Entries of another layout live under other keys; a value
that is foreign anyway (written by hand, by another version, truncated) fails verification, counts as
``corrupt``, is deleted and is a miss.

With ``encoding="fp8"`` or ``"int8"`` (``RedisTier(..., encoding=)``, or ``:encoding=NAME`` in ``--tiers``) the
payload is the block encoded by :mod:`aiokv.tiers._codec` (about half the bytes of a 16-bit block) and
``fingerprint`` is the encoded entry's (the layout's and the encoding's), so processes writing another encoding
use other keys. Encoding and decoding run off the loop and count against the call's deadline; a block that
cannot be encoded (not finite) is not stored, an entry that verifies but does not decode is a miss.

- ``lookup`` sends one pipelined ``EXISTS`` per key (one round trip for the whole prefix).
- ``read_into`` sends pipelined ``GET`` (``GETEX`` refreshing the TTL when ``ttl_s`` is set), in batches of at
  most ``max_batch_bytes``, verifies each value, then copies its payload into the caller's buffer.
- ``write`` sends pipelined ``SET`` (with ``PX`` when ``ttl_s`` is set). Eviction is the server's
  (``maxmemory`` + ``maxmemory-policy allkeys-lru`` is the recommended setup); values are never read back by the
  writer.

Failures never raise. Every call is bounded by ``timeout_s`` (socket timeouts plus an overall deadline);
a failed call is a miss / dropped write and is counted. After ``failures_to_down`` consecutive failures the
tier is ``"down"``: calls are answered locally without touching the network until a backoff interval
(``backoff_s``, doubling up to ``backoff_max_s`` after every failed probe) has passed, then the next call
probes the server. A successful call brings it back ``"up"``; a failure short of ``failures_to_down`` leaves it
``"degraded"``. A round trip whose replies say that the server (or, in a cluster, the node of a slot) cannot
serve now -- a dropped connection, ``CLUSTERDOWN``, ``LOADING``... -- is a failure too, even when other replies
of the same pipeline succeeded (those are used).

Cluster (``cluster=True``): keys are spread over the hash slots; redis-py splits each pipeline per node, and the
tier follows ``ASK`` / ``MOVED`` redirects itself (a few hops, one pipelined round trip per node each), so a live
reshard costs extra round trips, not misses. After a ``MOVED`` or a failed round trip the slot map is refreshed by
the next call, which finds a promoted replica as soon as the cluster has one. At most ``max_connections`` round
trips are in flight at once, so no node's pool runs dry.

Configuration errors raise at open: credentials the server refuses, or an ACL user not allowed the commands
this tier runs on its keys, raise :class:`~aiokv.InvalidArgumentError` from ``open()`` -- they would not go
away by themselves. A server that does not answer at open is not an error: the tier starts degraded or down.

The package: :mod:`._connection` (the URL, its redaction, redis-py's connection options, closing a client,
the server's value limit), :mod:`._replies` (what a reply or an error says: refused, unavailable, timed
out), :mod:`._values` (a block's entry as one or more values, and back), :mod:`._tier` (:class:`RedisTier`,
:class:`RedisTierStats`; the health breaker is :class:`aiokv.tiers._health.Breaker`).
"""

from __future__ import annotations

from ._tier import RedisTier, RedisTierStats

__all__ = ["RedisTier", "RedisTierStats"]
