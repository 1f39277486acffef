"""Models from S3 (or any S3-compatible store) through boto3.

S3 has no commits: the store's revision of a prefix is a hash of its objects' keys, sizes and ETags, so a
changed object is a new revision, and a pinned revision is checked against the listing. Each file is checked
against S3's own checksum: its SHA-256 when it was uploaded with one, else the ETag when that is an MD5 (a
single-part upload); a multipart upload without a SHA-256 has none to check (logged), and is then only
recorded by the cache's own SHA-256. Each file is one streamed GET (files in parallel), appended to a ``.part``
file that an interrupted pull resumes with a byte range.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from pathlib import Path

from fleetllm.store.checksum import Checksum
from fleetllm.store.errors import SourceUnreachable, StoreError
from fleetllm.store.remote import Listing, RemoteFile
from fleetllm.store.uri import ModelURI

log = logging.getLogger(__name__)
CHUNK = 8 << 20


class S3Source:
    """The objects under ``s3://bucket/prefix/``."""

    def __init__(self, uri: ModelURI, endpoint_url: str | None) -> None:
        import boto3
        from botocore.config import Config

        self.uri = uri
        # few retries: an unreachable store should fall back to the cache in seconds, not minutes
        self.client = boto3.client("s3", endpoint_url=endpoint_url,
                                   config=Config(retries={"max_attempts": 2}, connect_timeout=5, read_timeout=60))

    def _key(self, name: str) -> str:
        return f"{self.uri.prefix}/{name}" if self.uri.prefix else name

    def resolve(self, revision: str | None) -> Listing:
        objects = self._list()
        digest = hashlib.sha256()
        for name, (size, etag) in sorted(objects.items()):
            digest.update(f"{name}\0{size}\0{etag}\n".encode())
        commit = digest.hexdigest()[:40]
        if revision is not None and revision != commit:
            raise StoreError(f"model {self.uri}: the objects changed since revision {revision} (now {commit}); "
                             "redeploy with the new revision, or serve the pinned one from a cache", 409)
        return Listing(commit, {n: RemoteFile(n, size, _etag_checksum(etag)) for n, (size, etag) in objects.items()})

    def _list(self) -> dict[str, tuple[int, str]]:
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = f"{self.uri.prefix}/" if self.uri.prefix else ""
        objects: dict[str, tuple[int, str]] = {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.uri.bucket, Prefix=prefix):
                for o in page.get("Contents", []):
                    objects[o["Key"][len(prefix):]] = (o["Size"], o["ETag"].strip('"'))
        except ClientError as e:
            raise self._client_error(e) from None
        except BotoCoreError as e:
            raise SourceUnreachable(f"S3 unreachable ({type(e).__name__})") from None
        if not objects:
            raise StoreError(f"model {self.uri}: no objects under this prefix", 404)
        return objects

    def download(self, commit: str, f: RemoteFile, staging: Path) -> tuple[Path, Checksum | None]:
        from botocore.exceptions import BotoCoreError, ClientError

        target, part = staging / f.name, staging / f"{f.name}.part"
        part.parent.mkdir(parents=True, exist_ok=True)
        try:
            checksum = self._sha256(f) or f.checksum
            have = part.stat().st_size if part.exists() else 0
            if have < f.size:  # a .part left by an interrupted pull is resumed, not started over
                extra = {"Range": f"bytes={have}-"} if have else {}
                body = self.client.get_object(Bucket=self.uri.bucket, Key=self._key(f.name), **extra)["Body"]
                with open(part, "ab") as out:
                    for chunk in body.iter_chunks(CHUNK):
                        out.write(chunk)
        except ClientError as e:
            raise self._client_error(e) from None
        except BotoCoreError as e:
            raise SourceUnreachable(f"S3 unreachable ({type(e).__name__})") from None
        part.replace(target)
        if checksum is None:
            log.warning("model %s: %s has no source checksum (multipart upload without SHA-256); recorded by "
                        "its own SHA-256 only", self.uri, f.name)
        return target, checksum

    def _sha256(self, f: RemoteFile) -> Checksum | None:
        """The object's full-object SHA-256, if it was uploaded with one."""
        head = self.client.head_object(Bucket=self.uri.bucket, Key=self._key(f.name), ChecksumMode="ENABLED")
        value = head.get("ChecksumSHA256")
        if not value or "-" in value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
            return None
        return Checksum("sha256", base64.b64decode(value).hex())

    def _client_error(self, e: Exception) -> Exception:
        code = e.response.get("Error", {}).get("Code", "")  # type: ignore[attr-defined]
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 502))  # type: ignore[attr-defined]
        if status in (401, 403):
            return StoreError(f"model {self.uri}: S3 refused access ({code}): check the credentials", status)
        if status == 404:
            return StoreError(f"model {self.uri}: not found in S3 ({code})", 404)
        if status >= 500:
            return SourceUnreachable(f"S3 answered {status} ({code})")
        return StoreError(f"model {self.uri}: S3 answered {status} ({code})", 502)


def _etag_checksum(etag: str) -> Checksum | None:
    """A single-part upload's ETag is its MD5; a multipart one ("...-N") is not a digest of the file."""
    return None if "-" in etag or len(etag) != 32 else Checksum("md5", etag)
