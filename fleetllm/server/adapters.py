"""A worker's LoRA adapters as vLLM serves them: names as the request's ``model``, listed by ``/v1/models`` with
their ``parent``, loaded and unloaded at run time (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``).

:class:`Adapters` is what the HTTP side knows of adapters: it resolves a request's ``model`` (the base model,
an adapter, or a 404 naming both), checks a ``lora_path`` before anything is read (a local directory under
the allowed roots, or a store URI fetched into the model store's cache with the adapter's own token) and
hands the local directory to an :class:`AdapterBackend`: the engine's adapter registry
(:class:`fleetllm.server.engine_adapters.EngineAdapters`, the one place the server calls the engine about
adapters; a simulated worker's engine keeps the same registry's bookkeeping, without weights).
The backend's typed error (``status`` and message) becomes the HTTP answer; a refused adapter leaves nothing
loaded.

Who may call the two routes is the worker's door's business (:mod:`fleetllm.server.worker_secret`): the
fleet's secret when the worker has one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetllm.lora.modules import LoraModule, check_name
from fleetllm.server.protocol import APIError, json_object
from fleetllm.store.config import StoreConfig
from fleetllm.store.errors import StoreError
from fleetllm.store.uri import is_remote

if TYPE_CHECKING:
    from fleetllm.server.lora_metrics import LoraMetrics
    from fleetllm.store.store import Fetched

LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class AdapterBackend(Protocol):
    """Where adapters live once their files are local: the engine's registry, or the simulator's."""

    def names(self) -> list[str]:
        """Every adapter registered (resident in the step's tables, in memory behind them, or on disk)."""
        ...

    def resident(self) -> list[str]:
        """The adapters a request runs with now, without a load first (the step's tables)."""
        ...

    async def load(self, name: str, path: Path) -> None:
        """Register adapter ``name`` from local directory ``path``; raise an error with ``status`` (4xx) when it
        does not fit the model, leaving nothing registered."""
        ...

    def load_now(self, name: str, path: Path) -> None:
        """:meth:`load`, before the engine runs (a worker's ``--lora-modules``, as it starts)."""
        ...

    async def unload(self, name: str) -> None:
        """Forget adapter ``name`` (requests already running with it finish first)."""
        ...


class Adapters:
    """The adapters of one worker serving ``base`` (its served model name)."""

    def __init__(self, backend: AdapterBackend, base: str, store: StoreConfig | None = None,
                 allowed_roots: list[str] | None = None, modules: list[LoraModule] | None = None,
                 metrics: LoraMetrics | None = None) -> None:
        """``allowed_roots``: where local adapters may come from (default: the parents of the ``modules``' local
        paths and the store's cache); ``store``: how ``hf://`` and ``s3://`` adapters are fetched (its token
        settings are the base model's: an adapter gets its own module's, or none); ``metrics``: its series."""
        self.backend, self.base, self.metrics = backend, base, metrics
        self.store = store or StoreConfig()
        self.modules = {m.name: m for m in modules or []}
        roots = allowed_roots or [*(str(Path(m.path).expanduser().resolve().parent) for m in modules or []
                                    if not is_remote(m.path)), str(self.store.root())]
        self.allowed_roots = [Path(r).expanduser().resolve() for r in dict.fromkeys(roots)]
        self.sources: dict[str, str] = {}  # adapter -> what it was loaded from (its /v1/models `root`)
        self.created: dict[str, int] = {}
        self.revisions: dict[str, str] = {}  # a store adapter's commit (what its hf:// or s3:// source resolved to)
        self._held: dict[str, Fetched] = {}  # store adapters' cache entries, held while loaded

    def preload(self) -> None:
        """Load every ``--lora-modules`` adapter now, before the engine runs: one that cannot be loaded is an
        APIError here, so a worker with a bad module refuses to start (in one line) rather than serve without it."""
        for m in self.modules.values():
            self._check_new(m.name, m.path)
            local, fetched = self._local(m.path, m)
            try:
                self.backend.load_now(m.name, local)
            except Exception as e:
                raise _refused(m.name, e, fetched) from None
            self._loaded(m.name, m.path, fetched)

    def lora_for(self, model: Any) -> str | None:
        """The adapter a request's ``model`` names (None for the base model, or no model); 404 for neither."""
        if model is None or model == self.base:
            return None
        if isinstance(model, str) and model in self.backend.names():
            return model
        served = ", ".join([self.base, *sorted(self.backend.names())])
        raise APIError(404, f"The model `{model}` does not exist. Served: {served}", "model")

    async def load(self, name: Any, path: Any) -> None:
        """Check ``name`` and ``path``, bring the files local, register the adapter; APIError 4xx otherwise."""
        self._check_new(name, path)
        local, fetched = await asyncio.to_thread(self._local, path, None)
        try:
            await self.backend.load(name, local)
        except Exception as e:
            raise _refused(name, e, fetched) from None
        self._loaded(name, path, fetched)

    def _check_new(self, name: Any, path: Any) -> None:
        """A load's name and path as given: 400 unless a new adapter name and a path of some kind."""
        if not isinstance(name, str) or not name:
            raise APIError(400, "`lora_name` (a string) is required", "lora_name")
        if not isinstance(path, str) or not path:
            raise APIError(400, "`lora_path` (a local directory, hf://org/name[@revision] or s3://bucket/prefix) "
                                "is required", "lora_path")
        try:
            check_name(name, "lora_name")
        except ValueError as e:
            raise APIError(400, str(e), "lora_name") from None
        if name == self.base or name in self.backend.names():
            what = "the base model's name" if name == self.base else "already loaded (unload it first)"
            raise APIError(400, f"The lora adapter '{name}' is {what}", "lora_name")

    def _loaded(self, name: str, path: str, fetched: Fetched | None) -> None:
        self.sources[name], self.created[name] = path, int(time.time())
        if fetched is not None:  # held (not evicted from the store's cache) while the adapter is loaded
            self._held[name], self.revisions[name] = fetched, fetched.revision

    async def unload(self, name: Any) -> None:
        if not isinstance(name, str) or not name:
            raise APIError(400, "`lora_name` (a string) is required", "lora_name")
        if name not in self.backend.names():
            raise APIError(404, f"The lora adapter '{name}' cannot be found", "lora_name")
        await self.backend.unload(name)
        self._release(name)
        self.sources.pop(name, None)
        self.created.pop(name, None)

    def _local(self, path: str, module: LoraModule | None) -> tuple[Path, Fetched | None]:
        """``path`` as a local directory (and a store adapter's cache entry): a store URI fetched (pinned and
        checked), a local one under the roots (blocking: a fetch takes the network)."""
        if is_remote(path):
            cfg = replace(self.store, token_env=module.token_env if module else None,
                          token_file=module.token_file if module else None)
            try:
                fetched = _fetch_adapter(cfg, path)
            except StoreError as e:
                raise APIError(e.status if 400 <= e.status < 600 else 502, str(e), "lora_path") from None
            except ValueError as e:  # a malformed store URI
                raise APIError(400, str(e), "lora_path") from None
            return fetched.path, fetched
        if "://" in path:
            raise APIError(400, f"lora_path {path!r}: a local directory, hf://org/name[@revision] or "
                                "s3://bucket/prefix", "lora_path")
        real = Path(path).expanduser().resolve()  # symlinks and .. resolved before the roots are compared
        if not any(real == root or root in real.parents for root in self.allowed_roots):
            roots = ", ".join(map(str, self.allowed_roots))
            raise APIError(403, f"lora_path {path!r} is outside the allowed roots ({roots}): see "
                                "--allowed-local-lora-paths", "lora_path")
        if not real.is_dir():
            raise APIError(404, f"lora_path {path!r}: no such directory", "lora_path")
        return real, None

    def _release(self, name: str) -> None:
        """Let go of a store adapter's cache entry (it may be evicted again)."""
        self.revisions.pop(name, None)
        held = self._held.pop(name, None)
        if held is not None:
            held.release()

    def cards(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters, in vLLM's shape (``root``: the source, ``parent``: the base)."""
        out = []
        for name in sorted(self.backend.names()):
            module = self.modules.get(name)
            out.append({"id": name, "object": "model", "created": self.created.get(name, created),
                        "owned_by": "fleetllm", "root": self.sources.get(name, ""), "revision": self.revisions.get(name),
                        "parent": (module.base_model_name if module and module.base_model_name else self.base),
                        "max_model_len": None, "permission": []})
        return out

    def run_with(self, lora_name: str) -> dict[str, str]:
        """The engine's keywords for a request run with ``lora_name``, counted in its ``lora_name`` series."""
        if self.metrics is not None:
            self.metrics.request(lora_name)
        return {"lora_name": lora_name}

    def report(self) -> dict[str, list[str]]:
        """What routers learn from the worker's load report: adapters registered and resident."""
        return {"adapters": sorted(self.backend.names()), "resident_adapters": sorted(self.backend.resident())}

    def routes(self) -> list[Route]:
        """``POST /v1/load_lora_adapter {lora_name, lora_path}`` and ``POST /v1/unload_lora_adapter {lora_name}``."""

        async def load(request: Request) -> Response:
            body = json_object(await request.body())
            await self.load(body.get("lora_name"), body.get("lora_path"))
            return JSONResponse({"status": "ok", "lora_name": body["lora_name"]})

        async def unload(request: Request) -> Response:
            body = json_object(await request.body())
            await self.unload(body.get("lora_name"))
            return JSONResponse({"status": "ok", "lora_name": body["lora_name"]})

        return [Route(LOAD_PATH, load, methods=["POST"]), Route(UNLOAD_PATH, unload, methods=["POST"])]


def _refused(name: str, e: Exception, fetched: Fetched | None) -> Exception:
    """What a failed registration answers: the registry's typed error (a 4xx saying what does not fit) as an
    APIError; anything else as it is. The adapter's cache entry, if any, is let go either way."""
    if fetched is not None:
        fetched.release()
    status = getattr(e, "status", None)
    if isinstance(e, APIError) or not isinstance(status, int) or not 400 <= status < 500:
        return e
    return APIError(status, f"adapter {name!r}: {e}", "lora_path")


def _fetch_adapter(cfg: StoreConfig, ref: str) -> Fetched:
    """An adapter from the store: its commit's directory in the cache, verified, held (not evicted) while served."""
    from fleetllm.store.store import ModelStore

    return ModelStore(cfg).fetch(ref, adapter=True)


def no_adapter_routes() -> list[Route]:
    """The two routes on a worker without LoRA: 400 saying how to turn it on (vLLM's flag)."""

    async def refuse(request: Request) -> Response:
        raise APIError(400, "LoRA is off on this worker: start it with --enable-lora", "lora_name")

    return [Route(LOAD_PATH, refuse, methods=["POST"]), Route(UNLOAD_PATH, refuse, methods=["POST"])]
