"""Hugging Face TGI (``text-generation-launcher``): its router's gauges ``tgi_queue_size`` (waiting) and
``tgi_batch_current_size`` (running). TGI reports no KV usage and no KV events: the router-side prefix index
stands in."""

from fleetllm.router.backends.base import Backend

BACKEND = Backend(
    kind="tgi",
    running=("tgi_batch_current_size",),
    waiting=("tgi_queue_size",),
    metric_prefix="tgi_",
)
