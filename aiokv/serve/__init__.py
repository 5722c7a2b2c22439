"""``aiokv serve``: an OpenAI-compatible streaming HTTP server on the reference engine, with Prometheus
metrics and a graceful lifecycle (``pip install 'aiokv[serve]'``). See docs/serving.md.

* :func:`create_app` — the ASGI app (Starlette), to run under any ASGI server or mount in another app;
* :class:`Service` — the engine, the offloader and the request queue behind it;
* :class:`ServeConfig` — every setting, also as ``--flags`` and ``AIOKV_*`` environment variables;
* :class:`ByteTokenizer` — bytes plus special tokens, with the ChatML chat template;
* :func:`run` / :func:`serve` — what the command runs: uvicorn, signals, drain.

Names are imported on first use, so ``aiokv --help`` imports neither torch nor the web stack.
"""

import typing

from .. import _lazy

if typing.TYPE_CHECKING:
    from ._app import create_app
    from ._config import ServeConfig, TierSpec, parse_tiers
    from ._runner import ServerHandle, run, serve
    from ._schema import APIError
    from ._service import Generation, Service, ServiceState, ServiceStats
    from ._tokenizer import SPECIAL_TOKENS, ByteTokenizer, ChatMessage

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        "create_app": "._app",
        "ServeConfig": "._config",
        "TierSpec": "._config",
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
)

__all__ = [
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
    "TierSpec",
    "create_app",
    "parse_tiers",
    "run",
    "serve",
]
