"""Disaggregated prefill/decode: KV blocks computed on a prefill worker, handed to a decode worker.

- :mod:`.frame`   the wire format of a request's KV blocks (header, then layer-major data, checksummed),
  built and read in place.
- :mod:`.layer_stream`  writes a prefill's blocks layer by layer from its forward passes (a hook per layer)
  into a target: a frame, or the decode worker's own pool.
- :mod:`.direct`  same host: the prefill writes straight into blocks reserved in the decode worker's shared
  pool (:mod:`.shared_pool` maps it, :mod:`.leases` holds the blocks on the decode side); no frame, no copy after.
- :mod:`.buffers` the prefill worker's reused frame buffers (shared-memory files, or memory).
- :mod:`.arrival` how a frame's bytes reach the decode worker (HTTP body, shared memory being filled).
- :mod:`.kv_io`   export blocks from an engine's pool; reserve, write and commit them into another's.
- :mod:`.routes`  the worker endpoints' table and metrics: :mod:`.prefill_side` (``POST /pd/prefill``) and
  :mod:`.decode_side` (``POST /pd/kv``, ``/pd/reserve``, ``/pd/commit``, ``/pd/release``).
- :mod:`.config`  the transfer's settings (``--kv-transfer-dtype``, ``--kv-pool-shm``).
- :mod:`.router_path`  the router's side: whether to prefill remotely, and on which prefill worker.
- :mod:`.pd_auto`  ``--pd-threshold auto``: the per-request estimate of both paths, from measured rates.
"""
