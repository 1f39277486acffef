"""Client-side envelope encryption: each object under its own data key, the data key under a KMS key.

``seal`` asks KMS ``GenerateDataKey`` (AES-256) for a fresh key, encrypts the object with AES-GCM and
keeps only the KMS-encrypted copy of the key in the object's header; ``open_`` asks KMS ``Decrypt`` for
it back. Whoever reads the object without ``kms:Decrypt`` on the key (the bucket's owner included) sees
ciphertext. Layout: the :data:`MAGIC` line, one JSON header line, then nonce-prefixed ciphertext.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"FLEETLLM-ENVELOPE-1\n"
SUFFIX = ".enc"  # appended to an envelope-encrypted object's key


def is_sealed(data: bytes) -> bool:
    return data.startswith(MAGIC)


def seal(data: bytes, kms: Any, key_id: str) -> bytes:
    """``data`` encrypted under a new data key from KMS key ``key_id`` (``kms``: a boto3 KMS client)."""
    dk = kms.generate_data_key(KeyId=key_id, KeySpec="AES_256")
    nonce = os.urandom(12)
    header = {"alg": "AES-256-GCM", "kms_key_id": key_id,
              "encrypted_key": base64.b64encode(dk["CiphertextBlob"]).decode()}
    head = MAGIC + json.dumps(header).encode() + b"\n"
    # the header is authenticated with the data: swapping in another object's key fails the tag
    return head + nonce + AESGCM(dk["Plaintext"]).encrypt(nonce, data, head)


def open_(blob: bytes, kms: Any) -> bytes:
    """The plaintext of a :func:`seal` ed object; raises when KMS refuses or the data was altered."""
    if not is_sealed(blob):
        raise ValueError("not an envelope-encrypted capture object")
    end = blob.index(b"\n", len(MAGIC)) + 1
    head, rest = blob[:end], blob[end:]
    header = json.loads(head[len(MAGIC):])
    key = kms.decrypt(CiphertextBlob=base64.b64decode(header["encrypted_key"]), KeyId=header["kms_key_id"])
    return AESGCM(key["Plaintext"]).decrypt(rest[:12], rest[12:], head)


def key_id_of(blob: bytes) -> str:
    """The KMS key a sealed object's data key is wrapped under."""
    end = blob.index(b"\n", len(MAGIC))
    return json.loads(blob[len(MAGIC):end])["kms_key_id"]
