"""``Request.state`` and ``Request.token_ids`` are read-only (issue 22): only the request's own events and
steps change them, and the C fast path of ``step()`` still runs with them behind properties."""

from __future__ import annotations

import pytest

import aiokv
from aiokv import CPUTier, Offloader, RequestState
from aiokv._request import TokenView

from ._sim import SimEngine


@pytest.mark.asyncio
async def test_state_and_token_ids_cannot_be_assigned_or_mutated() -> None:
    eng = SimEngine(block_size=4)
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)]) as off:
        req = off.open("r", [1, 2, 3, 4, 5])
        assert req.state is RequestState.WAITING
        assert "WAITING" in repr(req)
        with pytest.raises(AttributeError):
            req.state = RequestState.RUNNING  # type: ignore[misc]
        with pytest.raises(AttributeError):
            req.token_ids = [9]  # type: ignore[misc]
        toks = req.token_ids
        assert isinstance(toks, TokenView)
        with pytest.raises(AttributeError):
            toks.append(6)  # type: ignore[attr-defined]
        with pytest.raises(TypeError):
            toks[0] = 7  # type: ignore[index]
        assert toks == [1, 2, 3, 4, 5]
        assert toks == (1, 2, 3, 4, 5)
        assert toks[1:3] == [2, 3]
        assert list(toks) == [1, 2, 3, 4, 5]
        assert len(toks) == 5
        assert 3 in toks
        await req.lookup()
        blocks = eng.alloc(2)
        assert blocks is not None
        req.step(5, new_token_ids=[6], new_block_ids=blocks)
        assert req.state is RequestState.RUNNING
        assert toks == [1, 2, 3, 4, 5, 6]  # a view: it follows the request's steps
        await req.finish()
        assert req.state is RequestState.FINISHED
        eng.release(blocks)


def test_token_view_does_not_hash_or_equal_other_types() -> None:
    view = TokenView([1, 2])
    with pytest.raises(TypeError):
        hash(view)
    assert view != "12"
    assert view == TokenView([1, 2])
    assert aiokv.Request.state.__doc__
