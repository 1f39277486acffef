"""fleetllm's own worker: load and KV events come together on its ``/kv/events`` stream
(:meth:`fleetllm.router.upstream.WorkerMonitor._events_loop`), nothing to poll; a worker publishing vLLM-format
events instead (``--kv-events-endpoint``) is polled for the same ``vllm:*`` gauges vLLM has."""

from fleetllm.router.backends import vllm
from fleetllm.router.backends.base import Backend

BACKEND = Backend(kind="fleetllm", running=vllm.BACKEND.running, waiting=vllm.BACKEND.waiting,
                  kv_usage=vllm.BACKEND.kv_usage, owned_by="fleetllm", metric_prefix="fleetllm_")
