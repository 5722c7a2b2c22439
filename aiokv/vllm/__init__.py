"""aiokv as a vLLM KV connector: one flag turns it on.

.. code-block:: python

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="AiokvConnector", kv_connector_module_path="aiokv.vllm", kv_role="kv_both",
        kv_connector_extra_config={"tiers": "cpu=4GiB,disk=/var/cache/aiokv:100GiB"}))

Importing this module imports vLLM. The options are :class:`ConnectorConfig`'s fields; see docs/vllm.md.
"""

from ._config import ConnectorConfig
from ._connector import AiokvConnector, AiokvConnectorStats
from ._meta import AiokvConnectorMetadata, AiokvWorkerMetadata

__all__ = [
    "AiokvConnector",
    "AiokvConnectorMetadata",
    "AiokvConnectorStats",
    "AiokvWorkerMetadata",
    "ConnectorConfig",
]
