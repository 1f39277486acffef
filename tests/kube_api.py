"""A Kubernetes API server's EndpointSlice answers on 127.0.0.1, for the router's discovery tests.

Serves what the real one serves at ``/apis/discovery.k8s.io/v1/namespaces/NS/endpointslices``: a list
(an ``EndpointSliceList`` with its ``resourceVersion``), and with ``?watch=true`` a chunked stream of
newline-delimited watch events that stays open until the test ends it (as the server does at
``timeoutSeconds``). The test drives it: :meth:`FakeKubeAPI.send` applies an event to the stored slices
and streams it to the open watch; :meth:`end_watch` closes the stream; ``fail_lists`` answers the next
lists with 500. A kubeconfig pointing the official client at it comes from :meth:`kubeconfig`.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

CLOSE = object()


class FakeKubeAPI:
    def __init__(self, items: list[dict[str, Any]], version: str) -> None:
        self.slices = {s["metadata"]["name"]: s for s in items}
        self.version = version
        self.requests: list[tuple[str, dict[str, list[str]]]] = []  # (path, query) of every request
        self.fail_lists = 0
        self.watching = threading.Event()  # a watch stream is open
        self._stream: queue.Queue[Any] = queue.Queue()  # the open watch stream's events to send
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeKubeAPI:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stream.put(CLOSE)
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path) -> Path:
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
               "clusters": [{"name": "test", "cluster": {"server": self.url}}],
               "users": [{"name": "test", "user": {"token": "test-token"}}],
               "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "llm"}}]}
        path.write_text(json.dumps(cfg))
        return path

    def send(self, event: dict[str, Any]) -> None:
        """Apply a watch event to the stored slices and stream it to the open watch (waits for one)."""
        obj = event["object"]
        with self._lock:
            if event["type"] == "DELETED":
                self.slices.pop(obj["metadata"]["name"], None)
            elif event["type"] in ("ADDED", "MODIFIED"):
                self.slices[obj["metadata"]["name"]] = obj
            if "resourceVersion" in obj.get("metadata", {}):
                self.version = obj["metadata"]["resourceVersion"]
        self._open_stream().put(event)

    def end_watch(self) -> None:
        """End the open watch stream, as the server does when its timeout is up (waits for one)."""
        stream = self._open_stream()
        self.watching.clear()
        stream.put(CLOSE)

    def _open_stream(self) -> queue.Queue[Any]:
        assert self.watching.wait(10), "the client never opened a watch"
        with self._lock:
            return self._stream

    def open_stream(self) -> queue.Queue[Any]:
        """A new watch stream's queue: events sent from now on go to it (an ended stream's never do)."""
        with self._lock:
            self._stream = queue.Queue()
            self.watching.set()
            return self._stream

    def close_stream(self, stream: queue.Queue[Any]) -> None:
        with self._lock:
            if stream is self._stream:
                self.watching.clear()

    def list_answer(self) -> dict[str, Any]:
        with self._lock:
            return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": self.version}, "items": list(self.slices.values())}


def _handler(api: FakeKubeAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            u = urlparse(self.path)
            query = parse_qs(u.query)
            api.requests.append((u.path, query))
            if not u.path.endswith("/endpointslices"):
                return self._json(404, _status(404, "NotFound", f"no route {u.path}"))
            if query.get("watch", [""])[0].lower() == "true":  # the Python client sends "True"
                return self._watch(float(query.get("timeoutSeconds", ["60"])[0]))
            if api.fail_lists:
                api.fail_lists -= 1
                return self._json(500, _status(500, "InternalError", "etcd unavailable"))
            return self._json(200, api.list_answer())

        def _json(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _watch(self, timeout_s: float) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            events = api.open_stream()
            end = time.monotonic() + timeout_s
            try:
                while time.monotonic() < end:
                    try:
                        ev = events.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    if ev is CLOSE:
                        break
                    line = (json.dumps(ev) + "\n").encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:  # the client went away (stopped, or reconnecting)
                pass
            finally:
                api.close_stream(events)
            self.close_connection = True

    return Handler


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``Status`` object, as the API server answers errors (and sends them in ERROR watch events)."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def gone_event() -> dict[str, Any]:
    """The ERROR event a watch gets when its resource version is too old (410 Gone)."""
    return {"type": "ERROR", "object": _status(410, "Expired", "too old resource version: 48213 (48990)")}
