"""The seam through which KV enters and leaves the engine (vLLM v1's ``KVConnectorBase_V1``, in miniature).

:mod:`.base` defines the two sides a connector implements and the step's metadata; :mod:`.access` the
engine's blocks as a connector sees them. Disaggregated prefill/decode (:mod:`fleetllm.disagg.connector`) is
a connector; the engine core knows none of them.
"""

from fleetllm.engine.kv_connector.access import BlockAccess
from fleetllm.engine.kv_connector.base import (
    KVCaches,
    KVConnector,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    StepKV,
)

__all__ = ["BlockAccess", "KVCaches", "KVConnector", "KVConnectorBase", "KVConnectorMetadata",
           "KVConnectorScheduler", "KVConnectorWorker", "StepKV"]
