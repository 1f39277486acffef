"""SGLang (``python -m sglang.launch_server``, ``--enable-metrics``): gauges of
``python/sglang/srt/metrics/collector.py``. SGLang publishes no KV events: the router-side prefix index stands in."""

from fleetllm.router.backends.base import Backend

BACKEND = Backend(
    kind="sglang",
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),  # share of the KV token pool in use
    owned_by="sglang",
    metric_prefix="sglang:",
)
