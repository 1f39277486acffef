"""The router's request path as a pipeline of small stages, in the manner of llm-d's endpoint picker:

admission → filters → scorers → picker → (the P/D stage)

- :mod:`.admission`  flow control: requests wait at the router until a copy of their model has a free batch slot,
  per priority band and, within a band, per tenant with weighted fair queuing, bulk work leaving a headroom of
  slots free; past a bound or a deadline they are shed (lowest band first) with 429/503 and ``Retry-After``;
  :mod:`.shared_flow` shares each tenant's held slots between routers through the state store.
- :mod:`.filters`    which workers may take a request: the model's copies, role, health and breaker, untried,
  bounded load.
- :mod:`.scorers`    the cost model's parts (:mod:`.cost`), each a scorer with a weight: queue, prefix, decode,
  KV pressure.
- :mod:`.pickers`    round robin, least load, session ring, lowest cost.
- :mod:`.pipeline`   a policy = filters + scorers + picker; :mod:`fleetllm.router.policies` names the
  router's five.

The P/D decision (:mod:`fleetllm.disagg.router_path`) runs on the picker's decision, before it is sent.
"""
