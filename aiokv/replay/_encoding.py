"""How many blocks a replayed persistent tier holds in its block encoding (``disk=2TiB:encoding=fp8``).

A tier of the replay given an ``encoding`` (:attr:`TierConfig.encoding`: ``"raw"``, ``"fp8"`` or ``"int8"``,
the encodings of :class:`aiokv.tiers.DiskTier` and :class:`aiokv.tiers.redis.RedisTier`) is sized as that real
tier sizes itself, with the real tier's code:

- the *payload* of a block is the codec's :attr:`~aiokv.tiers._codec.Codec.encoded_bytes`
  (:func:`~aiokv.tiers._codec.make_codec` over the slot segments of the model's KV, one
  ``(block_tokens, kv_heads, head_dim)`` segment for each of K and V of every layer, as vLLM's
  ``(2, num_blocks, block_size, kv_heads, head_dim)`` tensors or separate K and V tensors give them: one
  float32 scale per layer, K or V, and KV head), the block itself for ``raw``;
- an *entry* is what one block occupies of the tier's capacity: on disk ``round_up(128 + payload, 4096)``
  (the disk tier's :class:`~aiokv.tiers.disk._geometry._Geometry`, whose ``num_slots`` is the tier's block
  count), in Redis the 128-byte header plus the payload (one value, or several of the same total bytes);
- the bytes a load moves (the bandwidth model's) are the payload.

A tier without an encoding (``None``, the default) is sized as before encodings existed: its capacity over the
engine's block bytes, no header, no padding. Encodings other than ``raw`` need the model's KV shape
(:class:`~aiokv.replay.ModelPreset`'s layers, KV heads, head dim and dtype bytes) and a uniform cache: the real
tiers store a grouped layout's units raw only.

The tier modules (and torch, for the codec) are imported only when a tier has an encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import InvalidArgumentError
from ._model import ModelPreset

__all__ = ["ENCODED_TIER_KINDS", "TierSizing", "check_tier_encoding", "encoded_block_bytes", "tier_sizing"]

ENCODED_TIER_KINDS = {"disk": "disk", "redis": "redis", "redis-cluster": "redis"}
"""The tier names that may carry an encoding and the real tier they stand for (the persistent tiers)."""


@dataclass(frozen=True, slots=True)
class TierSizing:
    """One block (a unit, with KV-cache groups) in one replayed tier: ``encoding`` (``None``: not modelled),
    ``payload_bytes`` (what it holds of the block and what a load moves: encoded bytes) and ``entry_bytes``
    (what it takes of the tier's capacity: header and padding included)."""

    encoding: str | None
    payload_bytes: int
    entry_bytes: int
    kind: str | None = None  # "disk" or "redis" with an encoding

    def blocks(self, capacity_bytes: int | None) -> int | None:
        """The blocks ``capacity_bytes`` holds (``None``: unlimited), as the real tier counts them."""
        if capacity_bytes is None:
            return None
        if self.kind == "disk":
            from ..tiers import tier_entry

            return tier_entry("disk", self.payload_bytes, capacity_bytes)[1]
        return capacity_bytes // self.entry_bytes


def check_tier_encoding(name: str, encoding: object) -> str | None:
    """Validate :attr:`TierConfig.encoding` of the tier ``name``: ``None``, or an encoding of a tier named for a
    persistent tier (:data:`ENCODED_TIER_KINDS`)."""
    if encoding is None:
        return None
    from ..tiers import TIER_ENCODINGS

    if not isinstance(encoding, str) or encoding not in TIER_ENCODINGS:
        raise InvalidArgumentError(
            f"encoding of tier {name!r} must be one of {list(TIER_ENCODINGS)} (or left out), got {encoding!r}"
        )
    if name not in ENCODED_TIER_KINDS:
        raise InvalidArgumentError(
            f"encoding of tier {name!r} must not be set, got {encoding!r}: encodings apply to the persistent "
            "tiers, named 'disk', 'redis' or 'redis-cluster' in a replay (the CPU tier holds the engine's bytes)"
        )
    return encoding


def encoded_block_bytes(model: ModelPreset, block_tokens: int, encoding: str) -> int:
    """The payload of one block of ``block_tokens`` tokens of ``model``'s KV in ``encoding`` (the codec's
    ``encoded_bytes``; the block's bytes for ``raw``, and for a 1-byte dtype, which the codec stores raw)."""
    import torch

    from ..tiers import SegmentSpec, encoded_payload_bytes

    dtypes = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
    dtype = dtypes.get(model.dtype_bytes)
    if dtype is None:
        raise InvalidArgumentError(
            f"model.dtype_bytes must be one of {sorted(dtypes)} to size an encoded block, got {model.dtype_bytes}"
        )
    inner = (block_tokens, model.kv_heads, model.head_dim)
    layer_bytes = 2 * block_tokens * model.kv_heads * model.head_dim * model.dtype_bytes  # K and V
    segments = tuple(SegmentSpec(i * layer_bytes, 2, inner, dtype) for i in range(model.layers))
    decoded = model.layers * layer_bytes
    return encoded_payload_bytes(encoding, segments, decoded)


def tier_sizing(
    name: str,
    encoding: str | None,
    slot_bytes: int,
    *,
    block_tokens: int,
    model: ModelPreset | None,
    grouped: bool,
) -> TierSizing:
    """The :class:`TierSizing` of the tier ``name`` storing slots (blocks, or units with ``grouped``) of
    ``slot_bytes`` in ``encoding``. An encoding other than ``raw`` needs ``model`` (the KV shape) and no
    groups: :class:`InvalidArgumentError` naming what is missing otherwise."""
    encoding = check_tier_encoding(name, encoding)
    if encoding is None:
        return TierSizing(None, slot_bytes, slot_bytes)
    kind = ENCODED_TIER_KINDS[name]
    payload = slot_bytes
    if encoding != "raw":
        if grouped:
            raise InvalidArgumentError(
                f"encoding of tier {name!r} must be 'raw' (or None) with KV-cache groups, got {encoding!r}: the "
                "real tiers store a grouped layout's units raw (make_codec refuses a KVLayout.from_groups "
                "layout)"
            )
        if model is None:
            raise InvalidArgumentError(
                f"encoding of tier {name!r} must be 'raw' (or None) without the model's KV shape, got "
                f"{encoding!r}: an encoded block's size depends on its layers, KV heads, head dim and dtype; "
                "give model=ModelPreset(...) (the command line: --model, without --kv-bytes-per-token)"
            )
        if model.kv_bytes_per_token * block_tokens != slot_bytes:
            raise InvalidArgumentError(
                f"model.kv_bytes_per_token must be the replay's KV bytes per token, "
                f"{slot_bytes // block_tokens}, got {model.kv_bytes_per_token} ({model.name})"
            )
        payload = encoded_block_bytes(model, block_tokens, encoding)
    from ..tiers import tier_entry

    entry = tier_entry(kind, payload)[0]
    return TierSizing(encoding, payload, entry, kind)
