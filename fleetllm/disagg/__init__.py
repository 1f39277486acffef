"""Disaggregated prefill/decode: KV blocks computed on a prefill worker, shipped to a decode worker.

- :mod:`.frame`   the wire format of a request's KV blocks (header, then layer-major data, checksummed).
- :mod:`.kv_io`   export blocks from an engine's pool, import them into another's prefix cache.
- :mod:`.routes`  the worker endpoints: ``POST /pd/prefill`` (prefill role) and ``POST /pd/kv`` (decode).
- :mod:`.router_path`  the router's side: whether to prefill remotely, and on which prefill worker.
- :mod:`.pd_auto`  ``--pd-threshold auto``: the per-request estimate of both paths, from measured rates.
"""
