"""Shipping to S3 (a real S3 + KMS API on 127.0.0.1): SSE-KMS, deterministic keys, retries without
duplicates, client-side envelope encryption, and what a crash leaves in the spool."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fleetllm.capture import envelope
from fleetllm.capture.config import CaptureConfig
from fleetllm.capture.reader import CaptureSource
from fleetllm.capture.recorder import Capture
from fleetllm.capture.records import endpoint_record, payload
from fleetllm.capture.sinks import S3Sink

KEY_LAYOUT = re.compile(r"^p/fleetllm/AllTraffic/\d{4}/\d\d/\d\d/\d\d/\d\d-\d\d-\d{3}-[0-9a-f]{32}\.jsonl(\.enc)?$")


def _capture(tmp_path: Path, bucket: str, **settings) -> Capture:
    cfg = CaptureConfig(destination=f"s3://{bucket}/p", spool_dir=str(tmp_path / "spool"), **settings)
    return Capture(cfg, "router", ("endpoint", "access"))


def _record(i: int) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]})
    return endpoint_record(f"id-{i}", 1_800_000_000 + i, payload(body, "application/json", "INPUT"), None, {})


def _objects(s3, bucket: str) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_a_segment_becomes_one_sse_kms_object_at_sagemakers_key_layout(aws, tmp_path: Path):
    server, bucket, key_id = aws
    cap = _capture(tmp_path, bucket, kms_key_id=key_id)
    for i in range(3):
        cap.write("endpoint", _record(i))
    cap.close()
    s3 = server.client("s3")
    [key] = _objects(s3, bucket)
    assert KEY_LAYOUT.match(key), key
    head = s3.head_object(Bucket=bucket, Key=key)
    assert head["ServerSideEncryption"] == "aws:kms" and key_id in head["SSEKMSKeyId"]
    assert [r["eventMetadata"]["inferenceId"] for _, _, r in CaptureSource(f"s3://{bucket}/p").records()] == \
        ["id-0", "id-1", "id-2"]
    assert not cap.spool.ready() and cap.spool.bytes == 0  # deleted once confirmed


class LostAck:
    """A sink whose first put fails outright and whose second put lands but reports a failure."""

    def __init__(self, sink: S3Sink) -> None:
        self.sink, self.calls = sink, 0

    def put(self, key: str, data: bytes) -> None:
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("S3 is down")
        self.sink.put(key, data)
        if self.calls == 2:
            raise TimeoutError("the answer was lost")


def test_a_retried_upload_never_duplicates_an_object(aws, tmp_path: Path):
    server, bucket, _ = aws
    s3 = server.client("s3")
    cfg = CaptureConfig(destination=f"s3://{bucket}/p", spool_dir=str(tmp_path / "spool"))
    sink = LostAck(S3Sink(bucket, "p", client=s3))
    cap = Capture(cfg, "router", ("endpoint",), sink=sink)
    cap.write("endpoint", _record(0))
    cap.spool.seal_due(0)
    assert not cap.uploader.drain() and not cap.uploader.drain()  # down, then landed without an answer
    assert cap.uploader.drain()
    assert len(_objects(s3, bucket)) == 1 and sink.calls == 3
    assert 'fleetllm_capture_sink_errors_total 2.0' in _metrics(cap)


def _metrics(cap: Capture) -> str:
    from prometheus_client import generate_latest

    return generate_latest(cap.metrics.registry).decode()


def test_an_envelope_encrypted_object_is_unreadable_without_the_kms_key(aws, tmp_path: Path):
    server, bucket, key_id = aws
    cap = _capture(tmp_path, bucket, kms_key_id=key_id, envelope=True)
    cap.write("endpoint", _record(7))
    cap.close()
    s3, kms = server.client("s3"), server.client("kms")
    [key] = _objects(s3, bucket)
    blob = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert key.endswith(".jsonl.enc") and b"question 7" not in blob
    with pytest.raises(InvalidTag):  # any other key (a guess, another object's) fails authentication
        rest = blob[blob.index(b"\n", len(envelope.MAGIC)) + 1:]
        AESGCM(os.urandom(32)).decrypt(rest[:12], rest[12:], blob[:len(blob) - len(rest)])
    plain = envelope.open_(blob, kms)
    assert json.loads(plain)["eventMetadata"]["inferenceId"] == "id-7"
    import boto3

    elsewhere = boto3.client("kms", endpoint_url=server.endpoint_url, region_name="eu-west-1")
    with pytest.raises(elsewhere.exceptions.ClientError):  # a KMS that does not hold the key cannot unwrap it
        envelope.open_(blob, elsewhere)


def test_a_spool_a_crash_left_open_is_shipped_at_the_next_start(aws, tmp_path: Path):
    server, bucket, _ = aws
    first = _capture(tmp_path, bucket, batch_records=2)
    for i in range(3):  # one sealed segment of 2, one open segment of 1
        first.write("endpoint", _record(i))
    [open_seg] = list((tmp_path / "spool" / "router").glob("*.open"))
    with open(open_seg, "ab") as f:
        f.write(b'{"captureData": {"torn')  # the process died mid-write
    del first  # SIGKILL: no close, no upload

    second = _capture(tmp_path, bucket)
    assert second.spool.recovered == 2
    second.start()
    second.close()
    ids = sorted(r["eventMetadata"]["inferenceId"] for _, _, r in CaptureSource(f"s3://{bucket}/p").records())
    assert ids == ["id-0", "id-1", "id-2"]


def test_capture_stops_and_counts_drops_past_the_disk_threshold(tmp_path: Path):
    cfg = CaptureConfig(destination=str(tmp_path / "out"), disk_threshold_percent=0.0)
    cap = Capture(cfg, "router", ("endpoint",))
    assert cap.spool.check_disk()
    assert not cap.write("endpoint", _record(0))
    assert 'fleetllm_capture_records_total{outcome="dropped",tier="endpoint"} 1.0' in _metrics(cap)
