"""Deprecated names (issue 22): every old public name keeps working until aiokv 0.3.0, is the very object of its
new place, and warns on every access with a message naming that place and the release that removes it; the
new surface itself, and aiokv's own code, never warn."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
import types
import warnings

import pytest

import aiokv
from aiokv import _lazy

from .test_exports import PUBLIC_MODULES as EXPORTED_MODULES

REMOVED_IN = "0.3.0"

# old place -> new place (the changelog's "Redesign" section lists the same pairs)
DEPRECATED = {
    "aiokv.RequestHandle": "aiokv.Request",
    "aiokv.ThreadBridge": "aiokv.bridge.ThreadBridge",
    "aiokv.ThreadRequest": "aiokv.bridge.ThreadRequest",
    "aiokv.NONE_ROOT": "aiokv.rules.NONE_ROOT",
    "aiokv.make_root": "aiokv.rules.make_root",
    "aiokv.FaultyTier": "aiokv.testing.FaultyTier",
    "aiokv.FaultyTierStats": "aiokv.testing.FaultyTierStats",
    "aiokv.TierHealth": "aiokv.tiers.TierHealth",
    "aiokv.BackingTier": "aiokv.tiers.BackingTier",
    "aiokv.TierSpec": "aiokv.tiers.TierSpec",
    "aiokv.CPUTierStats": "aiokv.tiers.CPUTierStats",
    "aiokv.DiskTierStats": "aiokv.tiers.DiskTierStats",
    "aiokv.RedisTierStats": "aiokv.tiers.RedisTierStats",
    "aiokv.BlockIndex": "aiokv.tiers.BlockIndex",
    "aiokv.EntryState": "aiokv.tiers.EntryState",
    "aiokv.ARCPolicy": "aiokv.tiers.ARCPolicy",
    "aiokv.ChainLRUPolicy": "aiokv.tiers.ChainLRUPolicy",
    "aiokv.EvictionPolicy": "aiokv.tiers.EvictionPolicy",
    "aiokv.LRUPolicy": "aiokv.tiers.LRUPolicy",
    "aiokv.make_policy": "aiokv.tiers.make_policy",
    "aiokv.policy_names": "aiokv.tiers.policy_names",
    "aiokv.register_policy": "aiokv.tiers.register_policy",
    "aiokv.ExecutorStats": "aiokv.transfer.ExecutorStats",
    "aiokv.TransferExecutor": "aiokv.transfer.TransferExecutor",
    "aiokv.TransferFuture": "aiokv.transfer.TransferFuture",
    "aiokv.serve.TierSpec": "aiokv.serve.TierSetting",
    "aiokv.replay.MODEL_PRESETS": "aiokv.replay.COST_PRESETS",
}


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _old(dotted: str) -> tuple[types.ModuleType, str]:
    module, _, name = dotted.rpartition(".")
    return importlib.import_module(module), name


@pytest.mark.parametrize(("old", "new"), sorted(DEPRECATED.items()))
def test_a_deprecated_name_warns_on_every_access_and_is_the_new_object(old: str, new: str) -> None:
    module, name = _old(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new place itself does not warn
        target = _resolve(new)
    for _ in range(2):  # never cached: the second access warns too
        with pytest.warns(DeprecationWarning, match=re.escape(old)) as record:
            value = getattr(module, name)
        assert value is target
        assert len(record) == 1
        message = str(record[0].message)
        assert message.startswith(f"{old} is deprecated and will be removed in aiokv {REMOVED_IN}: ")
        assert new in message
        assert record[0].filename == __file__, "the warning names the line that used the old name"
    assert name not in vars(module)
    assert name not in dir(module)
    assert name not in module.__all__


def test_the_messages_say_where_to_import_from_or_what_to_use() -> None:
    with pytest.warns(DeprecationWarning, match=r"import it from aiokv\.tiers \(aiokv\.tiers\.BlockIndex\)$"):
        aiokv.BlockIndex  # noqa: B018
    with pytest.warns(DeprecationWarning, match=r"use aiokv\.Request instead"):
        aiokv.RequestHandle  # noqa: B018


def test_from_import_of_a_deprecated_name_warns_once_at_the_import_line() -> None:
    with pytest.warns(DeprecationWarning, match=r"^aiokv\.(BlockIndex|make_root) is deprecated") as record:
        from aiokv import BlockIndex, make_root
    assert len(record) == 2  # one per name: the import system's probe of each name does not warn
    assert {str(r.message).split(" ")[0] for r in record} == {"aiokv.BlockIndex", "aiokv.make_root"}
    assert all(r.filename == __file__ for r in record)
    from aiokv.rules import make_root as new_make_root
    from aiokv.tiers import BlockIndex as NewBlockIndex

    assert BlockIndex is NewBlockIndex
    assert make_root is new_make_root


def test_a_deprecated_name_is_an_error_under_the_error_filter() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(DeprecationWarning, match=r"aiokv\.TransferExecutor is deprecated"):
            aiokv.TransferExecutor  # noqa: B018
        with pytest.raises(DeprecationWarning):
            from aiokv import FaultyTier  # noqa: F401


def test_hasattr_sees_a_deprecated_name_and_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.warns(DeprecationWarning, match=r"aiokv\.BlockIndex"):
        assert hasattr(aiokv, "BlockIndex")
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        aiokv.NoSuchName  # noqa: B018
    with pytest.raises(ImportError):
        from aiokv import NoSuchName  # noqa: F401


def test_a_name_cannot_be_both_current_and_deprecated() -> None:
    with pytest.raises(ValueError, match="both current and deprecated"):
        _lazy.attach("aiokv", {"X": "._layout"}, deprecated={"X": _lazy.Moved("._layout", "aiokv.Y", "1")})


PUBLIC_MODULES = [*EXPORTED_MODULES, "aiokv.cli"]


def test_the_public_surface_and_aiokvs_own_code_emit_no_deprecation_warning() -> None:
    """A fresh interpreter imports every public module and touches every name of each ``__all__`` (which runs
    the lazy imports, so aiokv's own modules are imported too): no aiokv DeprecationWarning."""
    code = textwrap.dedent(
        f"""
        import importlib, warnings
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            import aiokv
            [getattr(aiokv, n) for n in aiokv.__all__]
            for name in {PUBLIC_MODULES!r}:
                try:
                    mod = importlib.import_module(name)
                except ImportError:  # an optional extra is missing: its names cannot be touched
                    continue
                for n in getattr(mod, "__all__", []):
                    try:
                        getattr(mod, n)
                    except ImportError:
                        pass
        bad = [f"{{w.filename}}:{{w.lineno}}: {{w.message}}" for w in seen
               if issubclass(w.category, DeprecationWarning) and str(w.message).startswith("aiokv")]
        assert not bad, bad
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
