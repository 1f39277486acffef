"""vLLM (``vllm serve``): load from ``vllm/v1/metrics/loggers.py``'s gauges; KV events over ZMQ when the router
is given the workers' ``--kv-events-config`` (:mod:`fleetllm.router.backends.vllm_events`)."""

from fleetllm.router.backends.base import Backend

BACKEND = Backend(
    kind="vllm",
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    # renamed in v0.10: gpu_cache_usage_perc -> kv_cache_usage_perc (both a 0..1 fraction despite the name)
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    owned_by="vllm",
    metric_prefix="vllm:",
)
