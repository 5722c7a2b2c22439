"""``aiokv serve``: an OpenAI-compatible streaming HTTP server on the reference engine, with Prometheus
metrics and a graceful lifecycle (``pip install 'aiokv[serve]'``). See docs/serving.md.

* :func:`create_app` — the ASGI app (Starlette), to run under any ASGI server or mount in another app;
* :class:`Service` — the engine, the offloader and the request queue behind it;
* :class:`ServeConfig` — every setting, also as ``--flags`` and ``AIOKV_*`` environment variables;
  :class:`TierSetting` — one parsed entry of ``--tiers`` (:func:`parse_tiers`); :data:`ENGINE_PRESETS` — the
  reference engine's model sizes ``--model`` chooses from;
* :class:`ByteTokenizer` — bytes plus special tokens, with the ChatML chat template;
* :func:`run` / :func:`serve` — what the command runs: uvicorn, signals, drain.

Names are imported on first use, so ``aiokv --help`` imports neither torch nor the web stack. ``TierSpec``, the
old name of :class:`TierSetting` (it clashed with :class:`aiokv.tiers.TierSpec`), still works with a
:class:`DeprecationWarning` until aiokv 0.3.0.
"""

import typing

from .. import _lazy

if typing.TYPE_CHECKING:
    from ._app import create_app
    from ._config import ENGINE_PRESETS, ServeConfig, TierSetting, parse_tiers
    from ._config import TierSpec as TierSpec
    from ._runner import ServerHandle, run, serve
    from ._schema import APIError
    from ._service import Generation, Service, ServiceState, ServiceStats
    from ._tokenizer import SPECIAL_TOKENS, ByteTokenizer, ChatMessage

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        "create_app": "._app",
        "ENGINE_PRESETS": "._config",
        "ServeConfig": "._config",
        "TierSetting": "._config",
        "parse_tiers": "._config",
        "ServerHandle": "._runner",
        "run": "._runner",
        "serve": "._runner",
        "APIError": "._schema",
        "Generation": "._service",
        "Service": "._service",
        "ServiceState": "._service",
        "ServiceStats": "._service",
        "SPECIAL_TOKENS": "._tokenizer",
        "ByteTokenizer": "._tokenizer",
        "ChatMessage": "._tokenizer",
    },
    deprecated={"TierSpec": _lazy.Moved("._config", "aiokv.serve.TierSetting", "0.3.0")},
)

__all__ = [
    "ENGINE_PRESETS",
    "SPECIAL_TOKENS",
    "APIError",
    "ByteTokenizer",
    "ChatMessage",
    "Generation",
    "ServeConfig",
    "ServerHandle",
    "Service",
    "ServiceState",
    "ServiceStats",
    "TierSetting",
    "create_app",
    "parse_tiers",
    "run",
    "serve",
]
