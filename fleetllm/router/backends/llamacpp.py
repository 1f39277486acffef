"""llama.cpp's ``llama-server``: ``/metrics`` (with ``--metrics``) has ``llamacpp:requests_processing`` and
``llamacpp:requests_deferred`` (``tools/server/server-task.cpp``); without it, ``/slots`` lists every slot with
``is_processing`` (``tools/server/server-context.cpp``; older builds: ``state``, 0 = idle). No KV events: the
router-side prefix index stands in."""

from __future__ import annotations

from typing import Any

from fleetllm.router.backends.base import Backend

BACKEND = Backend(
    kind="llamacpp",
    running=("llamacpp:requests_processing",),
    waiting=("llamacpp:requests_deferred",),
    kv_usage=("llamacpp:kv_cache_usage_ratio",),  # in older builds only
    owned_by="llamacpp",
    metric_prefix="llamacpp:",
)


def slots_load(slots: Any) -> dict[str, Any]:
    """Running requests from a ``/slots`` answer: the slots busy with a task."""
    if not isinstance(slots, list):
        return {}
    busy = sum(1 for s in slots if isinstance(s, dict) and (s.get("is_processing") or s.get("state", 0) != 0))
    return {"running": busy}
