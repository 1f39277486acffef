"""The router: an OpenAI-compatible gateway over many engine workers (``fleetllm router``).

- :mod:`.upstream`  the workers as the router sees them: health, load counted at dispatch, breaker,
  and the KV-event subscription that keeps the prefix index exact.
- :mod:`.index`     which worker holds which KV blocks (block hashes equal to the engine's).
- :mod:`.pipeline`  the request path's stages: admission (flow control, fair queuing), filters, scorers, pickers.
- :mod:`.policies`  round_robin, least_load, session, prefix, kv_aware: each a pipeline, by name.
- :mod:`.forward`   forwarding to a worker: load counted at dispatch, streams relayed byte for byte,
  retries before the first byte, circuit breaker.
- :mod:`.gateway`   the HTTP app: routes, lifespan, workers grouped by served model, tokenize and hash
  prompts, hand them to the forwarder (and to :mod:`fleetllm.disagg.router_path` for P/D).
"""
