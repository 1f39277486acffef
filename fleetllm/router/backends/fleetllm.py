"""fleetllm's own worker: load and KV events come together on its ``/kv/events`` stream
(:meth:`fleetllm.router.upstream.WorkerMonitor._events_loop`), nothing to poll."""

from fleetllm.router.backends.base import Backend

BACKEND = Backend(kind="fleetllm", owned_by="fleetllm", metric_prefix="fleetllm_", native_events=True)
