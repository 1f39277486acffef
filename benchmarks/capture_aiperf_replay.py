"""The official AIPerf replays a fleetllm endpoint-tier capture as it is (``sagemaker_data_capture``).

What it does:
  1. starts ``fleetllm serve --simulate`` with ``--capture-destination DIR`` (all tiers, 100 %), drives it with
     ``fleetllm bench`` (streaming chat), stops it (SIGTERM flushes the capture);
  2. starts the same fleet without capture and runs ``aiperf profile --input-file DIR/fleetllm/AllTraffic
     --custom-dataset-type sagemaker_data_capture --fixed-schedule`` against it;
  3. prints the captured request count and token totals beside AIPerf's; ``--record`` saves the run to results/.

Setup (once): ``benchmarks/install_aiperf.sh``. Run:  python benchmarks/capture_aiperf_replay.py [--requests 24]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_aiperf import AIPERF_DEFAULT, TOKENIZER_DEFAULT, aiperf_env, ensure_tokenizer  # noqa: E402
from capture_overhead import start  # noqa: E402
from common import save_run, stop_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PORT = 18740


def serve(tmp: Path, name: str, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "fleetllm.cli", "serve", "--simulate", "--replicas", "2", "--port", str(PORT),
           "--log-dir", str(tmp / name), *extra]
    return start(cmd, f"http://127.0.0.1:{PORT}/health", tmp / f"{name}.log", {})


def captured_totals(directory: Path) -> dict[str, int]:
    from fleetllm.capture.reader import CaptureSource

    usage = [json.loads(r["captureData"]["endpointOutput"]["data"])["usage"]
             for _, _, r in CaptureSource(directory).records("endpoint")]
    return {"requests": len(usage), "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
            "completion_tokens": sum(u["completion_tokens"] for u in usage)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--aiperf", default=str(AIPERF_DEFAULT))
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fleetllm-capture-aiperf-"))
    dest = tmp / "captures"
    fleet = serve(tmp, "captured", ["--capture-destination", str(dest), "--capture-flush-interval", "1"])
    try:
        subprocess.run([sys.executable, "-m", "fleetllm.cli", "bench", "--url", f"http://127.0.0.1:{PORT}", "--model",
                        "smollm2-135m", "--concurrency", "4", "--requests", str(args.requests), "--isl", "64",
                        "--osl", "16", "--no-progress", "--output", str(tmp / "traffic.json")], check=True,
                       capture_output=True, timeout=900)
    finally:
        stop_process(fleet)
    want = captured_totals(dest)
    art = tmp / "aiperf"
    fleet = serve(tmp, "replay", [])
    try:
        cmd = [args.aiperf, "profile", "--model", "smollm2-135m", "--url", f"http://127.0.0.1:{PORT}",
               "--endpoint-type", "chat", "--streaming", "--tokenizer", str(ensure_tokenizer(TOKENIZER_DEFAULT)),
               "--input-file", str(dest / "fleetllm" / "AllTraffic"), "--custom-dataset-type",
               "sagemaker_data_capture", "--fixed-schedule", "--fixed-schedule-auto-offset",
               "--use-legacy-max-tokens", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
               "--artifact-dir", str(art), "--ui-type", "none", "--no-gpu-telemetry", "--no-server-metrics",
               "--workers-max", "1", "--record-processors", "1"]
        subprocess.run(cmd, check=True, timeout=900, env=aiperf_env(), stdout=open(tmp / "aiperf.log", "wb"),
                       stderr=subprocess.STDOUT)
    finally:
        stop_process(fleet)
    doc = json.loads((art / "profile_export_aiperf.json").read_text())
    got = {"requests": int(doc["request_count"]["avg"]),
           "completion_tokens": int(doc.get("total_output_tokens", {}).get("avg", 0)),
           "prompt_tokens": int(doc.get("total_isl", {}).get("avg", 0))}
    line = f"captured {want}; AIPerf replayed {got} (log {tmp / 'aiperf.log'})"
    print(line)
    if args.record:
        save_run("## AIPerf replays a capture", "A captured fleet's traffic replayed by AIPerf.",
                 f"python benchmarks/capture_aiperf_replay.py --requests {args.requests}", f"- {line.split(' (log')[0]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
