"""The routing benchmark on a Ray fleet beside the same fleet of local processes (issue 18).

Starts a two-node Ray cluster on this machine (fleetllm/fleet/ray_local.py: head on 127.0.0.2, a second node
on 127.0.0.3), then for each policy runs benchmarks/routing.py's workloads twice against N simulated copies:
once as `fleetllm serve` starts them here (one process), once as Ray actors spread over both nodes, the
router discovering them through Ray. The question: does kv_aware's gain over round_robin hold on Ray?

    python benchmarks/ray_fleet.py --quick                    # 8 copies, round_robin vs kv_aware
    python benchmarks/ray_fleet.py --workers 16 --workloads multi-turn,agentic,zipf
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model, save_run  # noqa: E402
from routing import WORKLOADS, report, run_one  # noqa: E402

from fleetllm.fleet.ray_local import LocalNode, LocalRayCluster  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--policies", default="round_robin,kv_aware")
    ap.add_argument("--workloads", default="multi-turn,zipf")
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests, half the concurrency")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="results/ray_fleet")
    ap.add_argument("--record", action="store_true", help="save the run to results/ (for BENCHMARKS.md)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(width=170)
    wl = {k: v for k, v in WORKLOADS["sim"].items() if k in args.workloads.split(",")}
    load_before = os.getloadavg()
    cluster = LocalRayCluster([LocalNode("127.0.0.2", num_cpus=2, labels={"zone": "a"}),
                               LocalNode("127.0.0.3", num_cpus=2, labels={"zone": "b"})])
    t0 = time.monotonic()
    cluster.start()
    os.environ.update({k: v for k, v in cluster.env.items() if k.startswith("RAY_")})  # the drivers' settings
    console.print(f"ray cluster up in {time.monotonic() - t0:.1f}s at {cluster.address}")
    rows: list[dict] = []
    try:
        for policy in args.policies.split(","):
            for ray_address in (None, cluster.address):
                rows += run_one("sim", args.workers, policy, wl, out_dir, args.quick, args.seed,
                                ray_address=ray_address)
    finally:
        cluster.stop()
    verdicts = report(rows, console)
    load = f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    summary = {"command": " ".join(sys.argv), "cpu": cpu_model(), "cores": os.cpu_count(), "rows": rows,
               "verdicts": verdicts, "load_average": load, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out_dir / "ray_fleet.json").write_text(json.dumps(summary, indent=2))
    if args.record:
        save_run("## Routing on a Ray fleet (issue 18)", INTRO, "python " + " ".join(sys.argv),
                   _table(rows) + "\n" + "\n".join(f"- {v}" for v in verdicts) + f"\n\nLoad average: {load}.\n")
    return 0


INTRO = ("benchmarks/ray_fleet.py: the same N simulated copies (shipped SmolLM2 CPU timing model, real time) once "
         "as local processes (`fleetllm serve`), once as Ray actors over a two-node cluster of this machine "
         "(head 127.0.0.2, node 127.0.0.3; the router discovers the actors through Ray); benchmarks/routing.py's "
         "workloads and measures, fresh fleet per policy. `sim` = local, `ray-sim` = Ray.")


def _table(rows: list[dict]) -> str:
    lines = ["| fleet | workload | policy | TTFT p50 ms | vs RR | TTFT p99 ms | req/s | vs RR | hit rate | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rr = next(x for x in rows if x["fleet"] == r["fleet"] and x["workload"] == r["workload"]
                  and x["policy"] == "round_robin")
        lines.append(f"| {r['fleet']} | {r['workload']} | {r['policy']} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.0f} | {r['req_per_s']:.2f} | "
                     f"{r['req_per_s'] / rr['req_per_s']:.2f} | {r['hit_rate']:.1%} | {r['errors']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
