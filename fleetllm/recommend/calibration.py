"""The validation loop's correction: what this machine's serving path adds to the engine's measured steps.

``fleetllm calibrate`` times engine steps in-process; a deployed fleet adds the HTTP server, the router,
streaming every token and a benchmark client, all on the same cores. ``--validate`` measures deployed
candidates; :func:`fit` turns predicted-vs-measured rows into a step-time scale (from ITL p50) and a
per-request overhead (from TTFT p50 after that scale), written as ``calibration.json``; ``--calibration
FILE`` applies them to this machine's step model in a later run.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Calibration:
    step_scale: float = 1.0  # measured / predicted decode step time
    request_overhead_s: float = 0.0  # added to every request's TTFT (and E2E)
    source: str = "none"

    @classmethod
    def load(cls, path: str | Path | None) -> Calibration:
        if not path:
            return cls()
        d = json.loads(Path(path).read_text())
        return cls(**{k: d[k] for k in ("step_scale", "request_overhead_s")}, source=str(path))


def fit(rows: list[dict[str, Any]], previous: Calibration = Calibration()) -> dict[str, Any]:
    """Scale and overhead from validation rows (``predicted`` / ``measured`` dicts), medians over rows, on top
    of the ``previous`` calibration the predictions were made with."""
    ratio = statistics.median(r["measured"]["itl_p50_ms"] / r["predicted"]["itl_p50_ms"] for r in rows)
    extra = statistics.median((r["measured"]["ttft_p50_ms"] - r["predicted"]["ttft_p50_ms"] * ratio) / 1e3 for r in rows)
    overhead = max(0.0, previous.request_overhead_s * ratio + extra)
    return asdict(Calibration(round(previous.step_scale * ratio, 4), round(overhead, 4), f"{len(rows)} validation rows"))
