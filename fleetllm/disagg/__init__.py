"""Disaggregated prefill/decode: KV blocks computed on a prefill worker, shipped to a decode worker.

- :mod:`.frame`   the wire format of a request's KV blocks (header, then layer-major data, checksummed),
  built and read in place.
- :mod:`.layer_stream`  fills a frame layer by layer from the prefill's forward passes (a hook per layer).
- :mod:`.buffers` the prefill worker's reused frame buffers (shared-memory files, or memory).
- :mod:`.arrival` how a frame's bytes reach the decode worker (HTTP body, shared memory being filled).
- :mod:`.kv_io`   export blocks from an engine's pool; reserve, write and commit them into another's.
- :mod:`.routes`  the worker endpoints: ``POST /pd/prefill`` (prefill role) and ``POST /pd/kv`` (decode).
- :mod:`.config`  the transfer's settings (``--kv-transfer-dtype``).
- :mod:`.router_path`  the router's side: whether to prefill remotely, and on which prefill worker.
- :mod:`.pd_auto`  ``--pd-threshold auto``: the per-request estimate of both paths, from measured rates.
"""
