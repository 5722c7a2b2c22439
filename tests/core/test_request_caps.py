"""Per-request caps given to Offloader.open: max_store_tokens, max_load_tokens, store_decode."""

from __future__ import annotations

from typing import Any

import pytest

import aiokv
from aiokv import CPUTier, Offloader

from ._sim import SimEngine
from .test_request import _prefill_and_decode

pytestmark = pytest.mark.asyncio

BS = 4


def _offloader(eng: SimEngine, **kw: Any) -> Offloader:
    return Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)], **kw)


async def _serve(
    eng: SimEngine, off: Offloader, rid: str, prompt: list[int], decode: list[int], **kw: Any
) -> None:
    req = off.open(rid, prompt, **kw)
    await req.lookup()
    blocks = await _prefill_and_decode(eng, req, prompt, decode)
    await req.finish()
    eng.release(blocks)


async def _cached_tokens(off: Offloader, tokens: list[int]) -> int:
    probe = off.open("probe", [*tokens, 0])
    got = await probe.lookup()
    await probe.abort()
    return int(got)


@pytest.mark.parametrize(("cap", "stored"), [(None, 3), (0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (100, 3)])
async def test_max_store_tokens_stores_only_blocks_within_the_cap(cap: int | None, stored: int) -> None:
    """Prompt of 10 tokens, block 4, two sampled tokens: 11 tokens computed, blocks 0-1 full after the prefill
    and block 2 completed by decode. Only blocks ending at or before the cap are stored."""
    eng = SimEngine(block_size=BS)
    prompt = list(range(10))
    async with _offloader(eng) as off:
        await _serve(eng, off, "a", prompt, [20, 21, 22], max_store_tokens=cap)
        assert off.stats().blocks_stored == stored
        assert await _cached_tokens(off, [*prompt, 20, 21]) == stored * BS


async def test_store_decode_false_skips_blocks_completed_by_generated_tokens() -> None:
    """Prompt of 10 tokens (blocks 0-1 full within it, block 2 needs tokens 10-11 generated): with
    store_decode=False only blocks 0 and 1 are stored; with the default, block 2 too."""
    eng = SimEngine(block_size=BS)
    prompt = list(range(10))
    async with _offloader(eng) as off:
        await _serve(eng, off, "a", prompt, [20, 21, 22], store_decode=False)
        assert off.stats().blocks_stored == 2
        await _serve(eng, off, "b", prompt, [20, 21, 22])
        assert off.stats().blocks_stored == 3


async def test_store_decode_false_with_a_block_aligned_prompt_stores_the_whole_prompt() -> None:
    eng = SimEngine(block_size=BS)
    prompt = list(range(8))
    async with _offloader(eng) as off:
        await _serve(eng, off, "a", prompt, [20, 21, 22, 23, 24], store_decode=False)
        assert off.stats().blocks_stored == 2


@pytest.mark.parametrize(("cap", "want"), [(None, 8), (0, 0), (3, 0), (4, 4), (7, 4), (8, 8), (9, 8)])
async def test_lookup_never_returns_more_than_max_load_tokens(cap: int | None, want: int) -> None:
    eng = SimEngine(block_size=BS)
    prompt = list(range(9))
    async with _offloader(eng) as off:
        await _serve(eng, off, "seed", prompt, [1])
        req = off.open("a", prompt, max_load_tokens=cap)
        assert await req.lookup() == want
        dst = eng.alloc(want // BS)
        assert dst is not None
        assert await req.load(dst) == want
        await req.abort()


async def test_max_load_tokens_caps_a_partial_block_hit() -> None:
    """With store_partial_last_block the hit may end inside a block, but not past the cap: the cached partial
    block holds 3 tokens (8-10), a cap of 10 allows at most 2 of them, and no 2-token entry exists, so the
    hit is the 8 tokens of the full blocks; a cap of 11 allows the partial block."""
    eng = SimEngine(block_size=BS)
    async with _offloader(eng, store_partial_last_block=True) as off:
        turn1 = list(range(9))
        await _serve(eng, off, "t1", turn1, [40, 41, 42])  # 11 tokens computed: 2 full blocks + 3 tokens
        turn2 = [*turn1, 40, 41, 42, 7]
        full = off.open("full", turn2)
        assert await full.lookup() == 11
        await full.abort()
        capped = off.open("capped", turn2, max_load_tokens=10)
        assert await capped.lookup() == 8
        await capped.abort()
        exact = off.open("exact", turn2, max_load_tokens=11)
        assert await exact.lookup() == 11
        await exact.abort()


async def test_max_store_tokens_caps_a_partial_last_block() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng, store_partial_last_block=True) as off:
        await _serve(eng, off, "a", list(range(9)), [40, 41, 42], max_store_tokens=10)  # partial: tokens 8-10
        assert off.stats().blocks_stored == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_store_tokens": -1}, aiokv.InvalidArgumentError, r"max_store_tokens must be >= 0, got -1"),
        ({"max_load_tokens": -5}, aiokv.InvalidArgumentError, r"max_load_tokens must be >= 0, got -5"),
        (
            {"max_store_tokens": 1.5},
            aiokv.InvalidTypeError,
            r"max_store_tokens must be an int or None, got float",
        ),
        (
            {"max_load_tokens": True},
            aiokv.InvalidTypeError,
            r"max_load_tokens must be an int or None, got bool",
        ),
        ({"store_decode": 1}, aiokv.InvalidTypeError, r"store_decode must be a bool, got int"),
    ],
)
async def test_open_rejects_bad_caps_and_opens_nothing(
    kwargs: dict[str, Any], error: type, message: str
) -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        with pytest.raises(error, match=message):
            off.open("a", [1, 2, 3], **kwargs)
        assert off.get("a") is None
        req = off.open("a", [1, 2, 3])  # the id is still free
        await req.abort()


async def test_caps_are_shown_on_the_request() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        req = off.open("a", [1, 2, 3], max_store_tokens=8, max_load_tokens=4, store_decode=False)
        assert (req.max_store_tokens, req.max_load_tokens, req.store_decode) == (8, 4, False)
        plain = off.open("b", [1, 2, 3])
        assert (plain.max_store_tokens, plain.max_load_tokens, plain.store_decode) == (None, None, True)
        await req.abort()
        await plain.abort()
