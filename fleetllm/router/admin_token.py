"""The router's admin credential: a random token kept in a file only its owner can read.

It opens ``/admin/*`` and ``/router/state`` (``Authorization: Bearer <token>``), and nothing else grants
them but an ``admin`` API key: the workers' shared secret is refused there (403), so a worker, or whoever
reads a worker's environment, cannot change the fleet's membership. ``fleetllm serve`` mints one per fleet
into its log directory (or ``--admin-token-file``) and prints the file's path; ``fleetllm router`` does the
same when it is started alone. A file that exists is read, never rewritten: a platform can mount its own
(a Kubernetes Secret) and keep the token across restarts.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

FILE_NAME = "admin-token"


def read_token(path: str | Path) -> str:
    """The token in ``path``; ValueError if the file is empty."""
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"admin token file {path} is empty")
    return token


def mint_token(path: str | Path) -> str:
    """A new token written to ``path``, created 0600 (never through a symlink, never over a file)."""
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token


def load_or_mint(path: str | Path | None) -> tuple[str, Path]:
    """The token at ``path`` (minted there if the file does not exist; in a new private directory when no
    path is given) and where it is."""
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="fleetllm-router-")) / FILE_NAME  # mkdtemp: mode 0700
    path = Path(path)
    if path.exists():
        return read_token(path), path
    return mint_token(path), path


def admin_headers(path: str | Path) -> dict[str, str]:
    """The header an admin client (the fleet controller, ``fleetllm fleet``, tests) sends."""
    return {"authorization": f"Bearer {read_token(path)}"}
