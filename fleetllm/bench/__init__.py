"""fleetllm bench: an AIPerf-class load generator for any OpenAI-compatible endpoint.

The pieces, in the order a run uses them:

- ``workloads``: seeded generators of sessions (a session is one or more turns; a plain request is a
  session of one turn).
- ``load``: turns sessions into timed requests (fixed concurrency, or a rate with constant, Poisson or
  gamma arrivals, or trace timestamps) under request/duration limits.
- ``client``: sends one streaming request and records every chunk's arrival on a monotonic ns clock.
- ``metrics``: turns records into TTFT, ITL, TPOT, E2E, throughput, goodput; ``server_metrics``
  diffs the server's ``/metrics`` before and after.
- ``report`` / ``plots``: JSON, JSONL, CSV, console table, PNG plots and an HTML report.
- ``search``: sweeps and the SLO search for the highest load that still meets the limits.
"""
