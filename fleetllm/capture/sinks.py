"""Where captured objects end up: a local directory (the default) or S3. One small protocol, by scheme.

Keys are relative (``fleetllm/AllTraffic/2026/12/03/16/25-01-123-UUID.jsonl``); a sink puts them under
its root or prefix. ``put`` of an existing key replaces it, so a retried upload never duplicates. Reads
(``keys``, ``get``) serve ``fleetllm capture`` and ``fleetllm bench --trace``. Retention: a local
directory expires its own objects; for S3, a bucket lifecycle rule does it.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from fleetllm.capture.private import write_private

MULTIPART_BYTES = 8 * 1024 * 1024  # larger objects go up in parts


class Sink(Protocol):
    """A place objects are put to and read from."""

    def put(self, key: str, data: bytes) -> None: ...
    def keys(self, prefix: str = "") -> Iterator[str]: ...
    def get(self, key: str) -> bytes: ...
    def delete(self, key: str) -> None: ...


class LocalSink:
    """Objects as files under ``root`` (written to a temporary name and renamed: never half there), each
    readable by this user only (files 0600, the directories capture makes 0700)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def put(self, key: str, data: bytes) -> None:
        write_private(self.root / key, data)

    def keys(self, prefix: str = "") -> Iterator[str]:
        base = self.root / prefix if prefix else self.root
        if base.is_file():
            yield prefix
            return
        for p in sorted(base.rglob("*")):
            rel = p.relative_to(self.root)
            if p.is_file() and not any(part.startswith(".") for part in rel.parts):
                yield rel.as_posix()

    def get(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def expire(self, max_age_s: float) -> int:
        """Delete objects older than ``max_age_s`` (retention of a local destination); how many went."""
        cutoff = time.time() - max_age_s
        old = [k for k in self.keys() if (self.root / k).stat().st_mtime < cutoff]
        for k in old:
            self.delete(k)
        return len(old)


class S3Sink:
    """Objects in ``s3://bucket/prefix`` through boto3; with ``kms_key_id``, written with SSE-KMS."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 kms_key_id: str | None = None, client: Any = None) -> None:
        import boto3

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.client = client or boto3.client("s3", endpoint_url=endpoint_url)
        self.kms_key_id = kms_key_id

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        from boto3.s3.transfer import TransferConfig

        extra = {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": self.kms_key_id} if self.kms_key_id else {}
        self.client.upload_fileobj(io.BytesIO(data), self.bucket, self._full(key), ExtraArgs=extra,
                                   Config=TransferConfig(multipart_threshold=MULTIPART_BYTES, use_threads=False))

    def keys(self, prefix: str = "") -> Iterator[str]:
        full = self._full(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            for obj in page.get("Contents", []):
                yield obj["Key"][len(self.prefix) + 1:] if self.prefix else obj["Key"]

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._full(key))["Body"].read()

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._full(key))


def make_sink(destination: str, endpoint_url: str | None = None, kms_key_id: str | None = None) -> Sink:
    """The sink a destination names: ``s3://bucket/prefix``, else a local directory."""
    if destination.startswith("s3://"):
        bucket, _, prefix = destination[5:].partition("/")
        return S3Sink(bucket, prefix, endpoint_url, kms_key_id)
    return LocalSink(destination)
