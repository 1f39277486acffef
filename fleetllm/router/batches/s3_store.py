"""Files and batches kept in an S3 bucket (``--batch-dir s3://BUCKET/PREFIX``), so that a router restarted on
another machine finds and resumes them.

The same objects as :class:`~fleetllm.router.batches.store.BatchStore`'s directory, under ``PREFIX``::

    files/<file id>.json            the file object (and its owner)
    files/<file id>.data            its bytes
    batches/<batch id>.json         the batch object (and its owner)
    batches/<batch id>.done/<line>  one object per finished input line (S3 has no append: a PUT is atomic and
                                    durable once it returns, so a line counts as done exactly when its object is)

One router owns a prefix (as it owns a directory): the file and batch objects are read once and then served from
memory, every change written through. Credentials and endpoint are boto3's (``AWS_*`` variables,
``AWS_ENDPOINT_URL`` for another S3 API), as capture's.
"""

from __future__ import annotations

import json
from typing import Any

from fleetllm.errors import UsageError
from fleetllm.router.batches.store import BatchStore

SCHEME = "s3://"


class S3BatchStore(BatchStore):
    """Files and batches under ``s3://bucket/prefix``; each object a dict as the API shows it, plus its owner.
    (A :class:`BatchStore` for its callers: every method is this class's own.)"""

    def __init__(self, uri: str, endpoint_url: str | None = None) -> None:  # noqa: D107 - no directory to set up
        import boto3  # only a router whose batches live in S3 needs it

        bucket, _, prefix = uri[len(SCHEME):].partition("/")
        if not bucket:
            raise UsageError(f"--batch-dir {uri}: name a bucket, s3://BUCKET[/PREFIX]")
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.client = boto3.client("s3", endpoint_url=endpoint_url)
        self._objects: dict[str, dict[str, dict[str, Any]]] = {}  # kind -> id -> object, read once

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def _keys(self, prefix: str) -> list[str]:
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # S3's most per call
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})

    def _kind(self, kind: str) -> dict[str, dict[str, Any]]:
        if kind not in self._objects:
            found: dict[str, dict[str, Any]] = {}
            for key in self._keys(self._key(kind) + "/"):
                raw = self._get(key) if key.endswith(".json") else None
                if raw is not None:
                    obj = json.loads(raw)
                    found[obj["id"]] = obj
            self._objects[kind] = found
        return self._objects[kind]

    # ---- files ------------------------------------------------------------------------------------------
    def put_file(self, meta: dict[str, Any], data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key("files", f"{meta['id']}.data"), Body=data)
        self.save("files", meta)

    def file_data(self, file_id: str) -> bytes | None:
        return self._get(self._key("files", f"{file_id}.data"))

    def delete_file(self, file_id: str) -> None:
        self._delete([self._key("files", f"{file_id}{suffix}") for suffix in (".data", ".json")])
        self._kind("files").pop(file_id, None)

    # ---- objects (files and batches) --------------------------------------------------------------------
    def save(self, kind: str, obj: dict[str, Any]) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(kind, f"{obj['id']}.json"),
                               Body=json.dumps(obj).encode())
        self._kind(kind)[obj["id"]] = json.loads(json.dumps(obj))  # as stored, not the caller's live dict

    def load(self, kind: str, obj_id: str) -> dict[str, Any] | None:
        obj = self._kind(kind).get(obj_id)
        return json.loads(json.dumps(obj)) if obj is not None else None

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [json.loads(json.dumps(o)) for o in self._kind(kind).values()]

    def drop_batch(self, batch_id: str) -> None:
        self._delete([*self._keys(self._key("batches", f"{batch_id}.done/")),
                      self._key("batches", f"{batch_id}.json")])
        self._kind("batches").pop(batch_id, None)

    # ---- a batch's finished lines -----------------------------------------------------------------------
    def append_done(self, batch_id: str, index: int, ok: bool, line: dict[str, Any]) -> None:
        """Record input line ``index`` as finished (durably: stored before this returns)."""
        self.client.put_object(Bucket=self.bucket, Key=self._key("batches", f"{batch_id}.done", f"{index:09d}"),
                               Body=json.dumps({"i": index, "ok": ok, "line": line}).encode())

    def done(self, batch_id: str) -> dict[int, tuple[bool, dict[str, Any]]]:
        """Every finished line of a batch by index."""
        out = {}
        for key in self._keys(self._key("batches", f"{batch_id}.done/")):
            raw = self._get(key)
            if raw is not None:
                r = json.loads(raw)
                out[r["i"]] = (r["ok"], r["line"])
        return out
