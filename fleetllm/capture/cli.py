"""``fleetllm capture ls|show|decrypt|forget``: list, read, filter, decrypt and delete captures.

LOCATION is a capture directory (or one object file) or ``s3://bucket/prefix``; envelope-encrypted
objects are decrypted through KMS (the caller needs ``kms:Decrypt`` on the key).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from fleetllm.capture.config import TIERS
from fleetllm.capture.private import write_private
from fleetllm.capture.reader import CaptureSource, forget
from fleetllm.capture.records import record_id, record_status, record_time
from fleetllm.errors import UsageError


def _when(text: str, flag: str = "--since") -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise UsageError(f"{flag} {text!r}: an ISO time, e.g. 2026-05-01T12:00:00Z") from None


def source(args: argparse.Namespace) -> CaptureSource:
    """The captures ``LOCATION`` names; one that cannot hold any is refused (UsageError, one line)."""
    location = args.location
    if location.startswith("s3://"):
        if not location[5:].split("/", 1)[0]:
            raise UsageError(f"{location!r}: an S3 location is s3://bucket[/prefix]")
    elif not Path(location).exists():
        raise UsageError(f"{location!r}: no such capture directory or file (or give s3://bucket/prefix)")
    return CaptureSource(location, args.s3_endpoint_url)


def s3_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command`` with a bucket that cannot be reached or read said in one line (UsageError)."""

    def run(args: argparse.Namespace) -> int:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return command(args)
        except (BotoCoreError, ClientError) as e:
            raise UsageError(f"{args.location}: {type(e).__name__}: {e}") from None

    return run


def matches(args: argparse.Namespace, tier: str, record: dict[str, Any]) -> bool:
    """Whether a record passes the ``show`` filters (tier, request id, status, time range)."""
    if args.tier and tier != args.tier:
        return False
    if args.id and record_id(tier, record) != args.id:
        return False
    if args.status is not None and record_status(tier, record) != args.status:
        return False
    t = record_time(tier, record)
    return not ((args.since and t < _when(args.since)) or (args.until and t >= _when(args.until, "--until")))


def cmd_ls(args: argparse.Namespace) -> int:
    src = source(args)
    for key in src.keys():
        print(key)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    for flag, text in (("--since", args.since), ("--until", args.until)):
        if text:
            _when(text, flag)  # refused before any object is read
    src = source(args)
    shown = 0
    for _, tier, rec in src.records():
        if matches(args, tier, rec):
            print(json.dumps(rec, ensure_ascii=False))
            shown += 1
            if args.limit and shown >= args.limit:
                break
    return 0


def cmd_decrypt(args: argparse.Namespace) -> int:
    """Every object's plaintext: to stdout, or mirrored under ``--output`` (``.enc`` dropped)."""
    src = source(args)
    for key in src.keys():
        data = src.read(key)
        if args.output is None:
            sys.stdout.buffer.write(data)
            continue
        write_private(Path(args.output) / key.removesuffix(".enc"), data)  # plaintext: this user's eyes only
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    n = forget(source(args), args.id)
    print(f"deleted {n} record(s) of request {args.id}")
    return 0


def add_capture_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("capture", help="list, show, decrypt and forget captured requests")
    cs = c.add_subparsers(dest="capture_command", required=True)
    for name, func, doc in (("ls", cmd_ls, "every object key"), ("show", cmd_show, "records as JSON lines"),
                            ("decrypt", cmd_decrypt, "objects' plaintext"),
                            ("forget", cmd_forget, "delete every record of one request (by id)")):
        p = cs.add_parser(name, help=doc)
        p.add_argument("location", help="capture directory or file, or s3://bucket/prefix")
        p.add_argument("--s3-endpoint-url", default=None, help="S3 / KMS endpoint (default: boto3's)")
        p.set_defaults(func=s3_errors(func))
        if name == "show":
            p.add_argument("--tier", choices=TIERS, default=None)
            p.add_argument("--id", default=None, help="one request (the x-fleetllm-request-id)")
            p.add_argument("--status", type=int, default=None, help="HTTP status the client got")
            p.add_argument("--since", default=None, help="ISO time: requests that arrived at or after it")
            p.add_argument("--until", default=None, help="ISO time: requests that arrived before it")
            p.add_argument("--limit", type=int, default=0, help="stop after this many records")
        elif name == "decrypt":
            p.add_argument("--output", default=None, help="directory for the plaintext objects (default: stdout)")
        elif name == "forget":
            p.add_argument("--id", required=True, help="the request's x-fleetllm-request-id")
