"""A Hugging Face hub-compatible HTTP server for tests and benchmarks, on 127.0.0.1.

It serves the endpoints ``huggingface_hub`` uses to resolve and download a model: ``GET
/api/models/{repo}/revision/{rev}`` (commit + files with sizes, LFS SHA-256 and git blob ids) and ``HEAD|GET
/{repo}/resolve/{rev}/{file}`` (with ``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``, ``X-Linked-Size`` and byte
ranges). A gated repo answers 401 without a token and 403 with a wrong one, with the hub's ``X-Error-Code:
GatedRepo``. Branches can move while it runs (``move_branch``); downloads can be throttled to a link speed
shared by all of them; every request is recorded (path and whether it carried a token, never the token).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
CHUNK = 1 << 20


@dataclass
class HubRepo:
    """A model repo: commits (commit hash -> {file name: local path}) and branches (name -> commit)."""

    repo_id: str
    commits: dict[str, dict[str, Path]]
    branches: dict[str, str]
    token: str | None = None  # set: gated, requests need "Authorization: Bearer <token>"

    def commit_of(self, revision: str) -> str | None:
        return self.branches.get(revision) or (revision if revision in self.commits else None)


@dataclass
class FileMeta:
    size: int
    sha256: str
    git_sha1: str


def file_meta(path: Path, _cache: dict = {}) -> FileMeta:  # noqa: B006 - a deliberate per-process memo
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _cache:
        sha, git = hashlib.sha256(), hashlib.sha1(f"blob {st.st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK * 8):
                sha.update(chunk)
                git.update(chunk)
        _cache[key] = FileMeta(st.st_size, sha.hexdigest(), git.hexdigest())
    return _cache[key]


@dataclass
class HubState:
    repos: dict[str, HubRepo]
    throttle_bytes_per_s: float | None = None
    requests: list[tuple[str, str, bool]] = field(default_factory=list)  # (method, path, had a token)
    downloads: Counter = field(default_factory=Counter)  # (repo, file) -> full-file GETs started
    auth_headers: list[str] = field(default_factory=list)  # for the test that the token arrived here only
    _next_free: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def move_branch(self, repo_id: str, branch: str, commit: str) -> None:
        self.repos[repo_id].branches[branch] = commit

    async def pace(self, n: int) -> None:
        """Hold ``n`` bytes back until the shared link (``throttle_bytes_per_s``) has room for them."""
        if not self.throttle_bytes_per_s:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + n / self.throttle_bytes_per_s
            wait = self._next_free - now
        await asyncio.sleep(wait)


def hub_app(state: HubState) -> Starlette:
    """The ASGI app over ``state``."""

    def access(request: Request, repo: HubRepo) -> Response | None:
        auth = request.headers.get("authorization")
        state.requests.append((request.method, request.url.path, auth is not None))
        if auth:
            state.auth_headers.append(auth)
        if repo.token is None or auth == f"Bearer {repo.token}":
            return None
        status = 403 if auth else 401
        return Response(status_code=status, headers={
            "X-Error-Code": "GatedRepo",
            "X-Error-Message": f"Access to model {repo.repo_id} is restricted. You must have access to it."})

    def find(request: Request) -> tuple[HubRepo | None, str | None, Response | None]:
        repo = state.repos.get(f"{request.path_params['org']}/{request.path_params['name']}")
        if repo is None:
            return None, None, Response(status_code=404, headers={"X-Error-Code": "RepoNotFound"})
        denied = access(request, repo)
        if denied is not None:
            return repo, None, denied
        commit = repo.commit_of(request.path_params.get("revision", "main"))
        if commit is None:
            return repo, None, Response(status_code=404, headers={"X-Error-Code": "RevisionNotFound"})
        return repo, commit, None

    async def model_info(request: Request) -> Response:
        repo, commit, error = find(request)
        if error is not None:
            return error
        siblings = []
        for name, path in sorted(repo.commits[commit].items()):
            meta = file_meta(path)
            s = {"rfilename": name, "size": meta.size, "blobId": meta.git_sha1}
            if name.endswith(LFS_SUFFIXES):
                s["lfs"] = {"size": meta.size, "sha256": meta.sha256, "pointerSize": 134}
            siblings.append(s)
        return JSONResponse({"id": repo.repo_id, "modelId": repo.repo_id, "sha": commit, "private": False,
                             "gated": "auto" if repo.token else False, "siblings": siblings})

    async def resolve(request: Request) -> Response:
        repo, commit, error = find(request)
        if error is not None:
            return error
        path = repo.commits[commit].get(request.path_params["file"])
        if path is None:
            return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
        return serve_file(request, repo, commit, path)

    def serve_file(request: Request, repo: HubRepo, commit: str, path: Path) -> Response:
        meta = file_meta(path)
        lfs = path.name.endswith(LFS_SUFFIXES)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{meta.sha256 if lfs else meta.git_sha1}"',
                   "Accept-Ranges": "bytes", "Content-Length": str(meta.size)}
        if lfs:
            headers.update({"X-Linked-Etag": f'"{meta.sha256}"', "X-Linked-Size": str(meta.size)})
        if request.method == "HEAD":
            return Response(status_code=200, headers=headers)
        start = 0
        rng = request.headers.get("range", "")
        if rng.startswith("bytes="):
            start = int(rng[6:].split("-", 1)[0] or 0)
            headers.update({"Content-Range": f"bytes {start}-{meta.size - 1}/{meta.size}",
                            "Content-Length": str(meta.size - start)})
        else:
            state.downloads[(repo.repo_id, request.path_params["file"])] += 1
        return StreamingResponse(stream(path, start), status_code=206 if start else 200, headers=headers,
                                 media_type="application/octet-stream")

    async def stream(path: Path, start: int):
        with open(path, "rb") as f:
            f.seek(start)
            while chunk := f.read(CHUNK):
                await state.pace(len(chunk))
                yield chunk

    return Starlette(routes=[
        Route("/api/models/{org}/{name}", model_info, methods=["GET"]),
        Route("/api/models/{org}/{name}/revision/{revision:path}", model_info, methods=["GET"]),
        Route("/{org}/{name}/resolve/{revision}/{file:path}", resolve, methods=["GET", "HEAD"]),
    ])


class HubServer:
    """The hub app served on a thread of this process (127.0.0.1, a free port); ``stop()`` takes it down."""

    def __init__(self, state: HubState) -> None:
        from fleet_helpers import ThreadServer

        self.state = state
        self.server = ThreadServer(hub_app(state))
        self.endpoint = self.server.url

    def start(self) -> HubServer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
