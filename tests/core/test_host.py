"""A request sees its owner only through ``aiokv._host.RequestHost``: public names only, and ``_request.py``
uses no other (issue 22: the host protocol had 17 private members)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import aiokv
from aiokv._host import RequestHost

from ._sim import SimEngine

ROOT = Path(aiokv.__file__).resolve().parent


def test_the_host_has_public_names_only() -> None:
    assert RequestHost.__slots__
    private = [name for name in RequestHost.__slots__ if name.startswith("_")]
    assert private == []
    assert set(RequestHost.__annotations__) == set(RequestHost.__slots__)


def _host_attributes(source: str) -> list[tuple[int, str]]:
    """Every ``self._off.<name>`` and ``off.<name>`` (``off`` being the host) in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Attribute) and base.attr == "_off" and isinstance(base.value, ast.Name)) or (
            isinstance(base, ast.Name) and base.id == "off"
        ):
            out.append((node.lineno, node.attr))
    return out


def test_requests_use_only_the_hosts_public_names() -> None:
    used = _host_attributes((ROOT / "_request.py").read_text())
    assert len(used) > 30  # the scan sees the request's uses (it would pass vacuously otherwise)
    wrong = [(line, name) for line, name in used if name not in RequestHost.__slots__]
    assert wrong == [], f"_request.py uses names its host does not have: {wrong}"


def test_the_scan_catches_a_private_reach() -> None:
    planted = "def f(self):\n    return self._off._index\n"
    assert [name for _l, name in _host_attributes(planted)] == ["_index"]


def test_a_host_must_be_given_every_member() -> None:
    with pytest.raises(TypeError, match="missing"):
        RequestHost(layout=None)
    with pytest.raises(TypeError, match="unknown"):
        RequestHost(**{name: None for name in RequestHost.__slots__}, _index=None)


@pytest.mark.asyncio
async def test_requests_hold_the_host_not_the_offloader() -> None:
    eng = SimEngine(block_size=4)
    async with aiokv.Offloader(
        eng.layout, tiers=[aiokv.CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)]
    ) as off:
        req = off.open("r", list(range(5)))
        assert type(req._off) is RequestHost
        host = req._off
        assert host.loop is off.loop
        assert host.executor is off.executor
        assert host.thread is not None
        await req.finish()
