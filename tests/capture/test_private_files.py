"""What capture leaves on local disk is this user's alone, and nothing planted in its spool is shipped or
holds up the records behind it (uploads to a real S3 API on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from fleetllm.capture.config import CaptureConfig
from fleetllm.capture.private import UnsafePath
from fleetllm.capture.reader import CaptureSource
from fleetllm.capture.recorder import Capture, spool_dir
from fleetllm.capture.records import endpoint_record, payload


def _record(i: int) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]})
    return endpoint_record(f"id-{i}", 1_800_000_000 + i, payload(body, "application/json", "INPUT"), None, {})


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_local_capture_files_are_0600_and_their_directories_0700(tmp_path: Path):
    dest = tmp_path / "captures"
    cap = Capture(CaptureConfig(destination=str(dest)), "router", ("endpoint",))
    cap.write("endpoint", _record(0))
    [segment] = (dest / ".spool" / "router").glob("*.open")
    assert _mode(segment) == 0o600
    cap.close()
    files = [p for p in dest.rglob("*") if p.is_file()]
    dirs = [dest, *(p for p in dest.rglob("*") if p.is_dir())]
    assert files and {_mode(p) for p in files} == {0o600}
    assert {_mode(p) for p in dirs} == {0o700}


def test_the_default_s3_spool_is_under_the_users_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    root = spool_dir(CaptureConfig(destination="s3://bucket/prefix"))
    assert root.parent == runtime / "fleetllm" / "fleetllm-capture-spool" and _mode(root.parent) == 0o700


@pytest.mark.parametrize("plant", ["symlink", "open_dir"])
def test_a_shared_tmp_entry_planted_by_someone_else_is_passed_over(plant: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    shared, home = tmp_path / "tmp", tmp_path / "home"
    shared.mkdir(mode=0o777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setenv("HOME", str(home))
    planted = shared / f"fleetllm-capture-spool-{os.geteuid()}"
    if plant == "symlink":
        (tmp_path / "theirs").mkdir()
        planted.symlink_to(tmp_path / "theirs")
    else:
        planted.mkdir()
        planted.chmod(0o777)  # anyone may write there
    root = spool_dir(CaptureConfig(destination="s3://bucket/prefix"))
    assert root.parent == home / ".cache" / "fleetllm" / "fleetllm-capture-spool"
    assert not any((tmp_path / "theirs").iterdir()) if plant == "symlink" else not any(planted.iterdir())


def test_a_configured_spool_dir_others_may_write_is_refused(tmp_path: Path):
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o777)
    spool.chmod(0o777)
    with pytest.raises(UnsafePath, match="writable by group or others"):
        Capture(CaptureConfig(destination=str(tmp_path / "out"), spool_dir=str(spool)), "router", ("endpoint",))


def _plant(spool: Path, created_ms: int, suffix: str = ".ready") -> Path:
    return spool / f"endpoint~{created_ms}~{uuid.uuid4().hex}{suffix}"


def _rejected(cap: Capture) -> dict[str, float]:
    text = generate_latest(cap.metrics.registry).decode()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("fleetllm_capture_spool_rejected_total{")}


def test_a_planted_symlink_and_a_malformed_segment_do_not_stop_uploads(aws, tmp_path: Path):
    server, bucket, _ = aws
    spool = tmp_path / "spool" / "router"
    spool.mkdir(parents=True, mode=0o700)
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps({"leak": "a file of this user the spool must not ship"}) + "\n")
    _plant(spool, 1).symlink_to(outside)  # older than any real segment: shipped first, were it followed
    _plant(spool, 2).write_bytes(b'{"captureData": {"torn')  # truncated
    _plant(spool, 3).write_bytes(b"\x00\x01garbage\n")
    os.link(outside, _plant(spool, 4))  # a hard link to a file of ours
    (spool / "junk.ready").write_bytes(b"{}\n")  # no name the spool gives
    cfg = CaptureConfig(destination=f"s3://{bucket}/p", spool_dir=str(tmp_path / "spool"), flush_interval_s=0.1)
    cap = Capture(cfg, "router", ("endpoint",))
    cap.start()
    cap.write("endpoint", _record(1))
    source = CaptureSource(f"s3://{bucket}/p", server.endpoint_url)
    end = time.monotonic() + 20
    while not list(source.keys()) and time.monotonic() < end:  # shipped by the uploader thread itself
        time.sleep(0.05)
    assert cap.uploader._thread.is_alive()
    cap.close()
    assert [r["eventMetadata"]["inferenceId"] for _, _, r in source.records()] == ["id-1"]
    assert _rejected(cap) == {"hard_link": 1.0, "malformed": 2.0, "name": 1.0, "symlink": 1.0}
    assert sorted(p.suffix for p in spool.iterdir()) == [".rejected"] * 5
    assert json.loads(outside.read_text())["leak"]  # the target is untouched


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_segment_owned_by_another_user_is_set_aside(tmp_path: Path):
    cfg = CaptureConfig(destination=str(tmp_path / "out"), spool_dir=str(tmp_path / "spool"))
    cap = Capture(cfg, "router", ("endpoint",))
    foreign = _plant(cap.spool.dir, 1)
    foreign.write_bytes(json.dumps(_record(0)).encode() + b"\n")
    os.chown(foreign, 12345, 12345)
    cap.write("endpoint", _record(1))
    cap.close()
    assert [r["eventMetadata"]["inferenceId"] for _, _, r in CaptureSource(tmp_path / "out").records()] == ["id-1"]
    assert _rejected(cap) == {"foreign_owner": 1.0}
