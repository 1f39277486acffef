"""Reading captures back: every object under a local directory (or file) or ``s3://bucket/prefix``,
decrypted when envelope-encrypted, as (tier, record) pairs. Used by ``fleetllm capture`` and
``fleetllm bench --trace``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fleetllm.capture import envelope
from fleetllm.capture.records import record_id, tier_of
from fleetllm.capture.sinks import LocalSink, Sink, make_sink


class CaptureSource:
    """The capture objects under ``location`` (a directory, one file, or ``s3://bucket/prefix``)."""

    def __init__(self, location: str | Path, endpoint_url: str | None = None) -> None:
        self.location, self.endpoint_url = str(location), endpoint_url
        self._kms: Any = None
        path = Path(self.location)
        if not self.location.startswith("s3://") and path.is_file():
            self.sink: Sink = LocalSink(path.parent)
            self._only: str | None = path.name
        else:
            self.sink = make_sink(self.location, endpoint_url)
            self._only = None

    def keys(self) -> list[str]:
        """Object keys, in key order (which is time order within a tier)."""
        return [self._only] if self._only else list(self.sink.keys())

    def read(self, key: str) -> bytes:
        """An object's plaintext (KMS ``Decrypt`` for an envelope-encrypted one)."""
        data = self.sink.get(key)
        if envelope.is_sealed(data):
            data = envelope.open_(data, self.kms())
        return data

    def kms(self) -> Any:
        if self._kms is None:
            import boto3

            self._kms = boto3.client("kms", endpoint_url=self.endpoint_url)
        return self._kms

    def records(self, tier: str | None = None) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """(key, tier, record) for every record (of ``tier`` only, when given)."""
        for key in self.keys():
            if not key.endswith((".jsonl", ".jsonl" + envelope.SUFFIX)):
                continue
            for line in self.read(key).splitlines():
                if not line.strip():
                    continue
                rec = json.loads(line)
                t = tier_of(rec)
                if tier is None or t == tier:
                    yield key, t, rec


def forget(source: CaptureSource, request_id: str) -> int:
    """Delete every record of ``request_id`` (retention: a request's records on demand); how many went.

    An object holding other records is rewritten without them (re-sealed under the same KMS key)."""
    gone = 0
    for key in source.keys():
        raw = source.sink.get(key)
        plain = source.read(key)
        lines = plain.splitlines(keepends=True)
        kept = [x for x in lines if not x.strip() or record_id(tier_of(json.loads(x)), json.loads(x)) != request_id]
        if len(kept) == len(lines):
            continue
        gone += len(lines) - len(kept)
        if not any(x.strip() for x in kept):
            source.sink.delete(key)
            continue
        data = b"".join(kept)
        if envelope.is_sealed(raw):
            data = envelope.seal(data, source.kms(), envelope.key_id_of(raw))
        source.sink.put(key, data)
    return gone
