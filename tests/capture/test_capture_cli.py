"""``fleetllm capture ls|show|decrypt|forget`` and ``fleetllm bench --trace`` over a capture directory."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

from fleetllm.capture.config import CaptureConfig
from fleetllm.capture.recorder import Capture
from fleetllm.capture.records import endpoint_record, payload, tier_of
from fleetllm.cli import main

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def captured(capture_fleet, tmp_path_factory):
    """A fleet and what it captured of 8 answered requests (4 streamed) and one malformed one."""
    fleet = capture_fleet(destination=str(tmp_path_factory.mktemp("captured")))
    ids = []
    with httpx.Client(timeout=30) as client:
        for i in range(8):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"question number {i}"}],
                    "max_tokens": 3 + i, "stream": i % 2 == 1}
            r = client.post(fleet.router_url + "/v1/chat/completions", json=body,
                            headers={"x-request-id": uuid.uuid4().hex})
            assert r.status_code == 200
            ids.append(r.headers["x-fleetllm-request-id"])
        assert client.post(fleet.router_url + "/v1/chat/completions", content=b"nope").status_code == 400
    fleet.flush()
    return fleet, ids


def _show(capsys, *args: str) -> list[dict]:
    assert main(["capture", "show", *args]) == 0
    return [json.loads(x) for x in capsys.readouterr().out.splitlines()]


def test_show_filters_by_tier_request_id_status_and_time(captured, capsys):
    fleet, ids = captured
    where = fleet.cfg.destination
    assert len(_show(capsys, where, "--tier", "endpoint")) == 9
    assert [r["fleetllm"]["status"] for r in _show(capsys, where, "--tier", "endpoint", "--status", "400")] == [400]
    one = _show(capsys, where, "--id", ids[3])
    assert sorted(tier_of(r) for r in one) == ["access", "endpoint", "worker"]
    assert _show(capsys, where, "--since", "2999-01-01T00:00:00Z") == []
    assert main(["capture", "ls", where]) == 0
    keys = capsys.readouterr().out.split()
    assert any(k.startswith("fleetllm/AllTraffic/") for k in keys) and any("/_worker/" in k for k in keys)


def test_bench_replays_a_capture_directory_with_its_request_count_and_tokens(captured, tmp_path: Path):
    fleet, ids = captured
    records = [r for r in fleet.records("endpoint") if r["fleetllm"]["status"] == 200]
    usage = [json.loads(r["captureData"]["endpointOutput"]["data"])["usage"] for r in records]
    out = tmp_path / "replay.json"
    assert main(["bench", "--url", fleet.router_url, "--model", MODEL, "--workload", "trace", "--trace",
                 fleet.cfg.destination, "--trace-speedup", "20", "--no-progress", "--output", str(out)]) == 0
    replayed = [json.loads(x) for x in (tmp_path / "replay.requests.jsonl").read_text().splitlines()]
    assert len(replayed) == len(ids) == 8 and not any(r["error"] for r in replayed)
    assert sum(r["output_tokens"] for r in replayed) == sum(u["completion_tokens"] for u in usage)
    assert sum(r["input_tokens"] for r in replayed) == sum(u["prompt_tokens"] for u in usage)


def test_forget_deletes_every_record_of_one_request(captured, capsys):
    fleet, ids = captured
    assert main(["capture", "forget", fleet.cfg.destination, "--id", ids[0]]) == 0
    assert "deleted 3 record(s)" in capsys.readouterr().out  # endpoint, access, worker
    assert _show(capsys, fleet.cfg.destination, "--id", ids[0]) == []
    assert len(_show(capsys, fleet.cfg.destination, "--id", ids[1])) == 3


def test_decrypt_with_the_kms_key_returns_the_original_json(aws, tmp_path: Path, capsys):
    server, bucket, key_id = aws
    cfg = CaptureConfig(destination=f"s3://{bucket}/p", spool_dir=str(tmp_path / "spool"), kms_key_id=key_id,
                        envelope=True)
    cap = Capture(cfg, "router", ("endpoint",))
    body = json.dumps({"messages": [{"role": "user", "content": "secret question"}]})
    rec = endpoint_record("req-1", 1_800_000_000, payload(body, "application/json", "INPUT"), None, {"status": 200})
    cap.write("endpoint", rec)
    cap.close()
    assert main(["capture", "decrypt", f"s3://{bucket}/p", "--s3-endpoint-url", server.endpoint_url,
                 "--output", str(tmp_path / "plain")]) == 0
    [plain] = list((tmp_path / "plain").rglob("*.jsonl"))
    assert json.loads(plain.read_text()) == rec
