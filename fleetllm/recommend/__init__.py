"""``fleetllm recommend``: the deployment that meets latency targets at the lowest cost.

catalogue (hardware and formats, a data file) -> model_shape (what the model weighs and computes) ->
perf_model (per-step roofline, or the measured timing profile on this machine) -> queueing (analytic,
for pruning) -> search (every candidate) -> fleet_sim (the real scheduler in virtual time, for the top
ones) -> report (table, Pareto PNG, fleet YAML, JSON); validate measures the top local ones.
"""
