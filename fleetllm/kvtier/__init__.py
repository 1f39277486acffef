"""KV cache tiers beyond a worker's pool, each a KV connector (:mod:`fleetllm.engine.kv_connector`).

:mod:`.host`: blocks evicted from the pool kept in host memory (``--kv-offload-gb``), keyed by the block-hash
chain the engine, the router and the P/D transfer share, and brought back instead of recomputed
(:mod:`.connector`); :mod:`.metrics`: per tier hits, misses, bytes, load seconds and errors.
"""
