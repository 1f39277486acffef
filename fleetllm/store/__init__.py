"""The model store: where a model's files come from, and the node-local cache they are served from.

A model reference is a local path or alias, ``hf://org/name[@revision]`` (a Hugging Face hub, through
``huggingface_hub``) or ``s3://bucket/prefix`` (through boto3). A remote reference resolves once to a commit
(the hub's commit hash; for S3 a hash of the objects' ETags), and the commit is what the cache keys, what
``/v1/models`` shows and what a fleet pins. Files enter the cache only after their source's checksum
matched; every load checks them again against the cache's manifest.

Modules: ``uri`` (parsing), ``config`` (settings), ``secret`` (per-model tokens), ``errors``, ``checksum``,
``selection`` (which files a loader needs), ``cache`` (layout, manifest, locks, LRU), ``remote`` (what a source
is), ``hub`` and ``s3`` (the sources), ``store`` (resolve -> download -> verify, with fallbacks), ``pin`` (a
fleet's sources pinned at deploy), ``phases`` (cold-start timing), ``prefetch`` (a worker's fetch overlapping its imports), ``cli``
(``fleetllm models``).
"""

from fleetllm.store.config import StoreConfig
from fleetllm.store.errors import StoreError
from fleetllm.store.uri import ModelURI, is_remote

__all__ = ["ModelURI", "StoreConfig", "StoreError", "is_remote"]
