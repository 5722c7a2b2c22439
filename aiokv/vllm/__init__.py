"""aiokv as a vLLM KV connector: one flag turns it on.

.. code-block:: python

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="AiokvConnector", kv_connector_module_path="aiokv.vllm", kv_role="kv_both",
        kv_connector_extra_config={"tiers": "cpu=4GiB,disk=/var/cache/aiokv:100GiB"}))

The options are :class:`ConnectorConfig`'s fields (docs/vllm.md). ``ConnectorConfig`` needs no vLLM; the
connector and its metadata import vLLM on first use.
"""

import typing

from .. import _lazy
from ._config import ConnectorConfig

if typing.TYPE_CHECKING:
    from ._connector import AiokvConnector, AiokvConnectorStats
    from ._meta import AiokvConnectorMetadata, AiokvWorkerMetadata

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        "AiokvConnector": "._connector",
        "AiokvConnectorStats": "._connector",
        "AiokvConnectorMetadata": "._meta",
        "AiokvWorkerMetadata": "._meta",
    },
)

__all__ = [
    "AiokvConnector",
    "AiokvConnectorMetadata",
    "AiokvConnectorStats",
    "AiokvWorkerMetadata",
    "ConnectorConfig",
]
