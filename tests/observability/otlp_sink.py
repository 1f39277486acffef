"""A tiny OTLP/HTTP receiver for tests: records every POSTed protobuf and decodes it with the
opentelemetry-proto classes (metrics at /v1/metrics, spans at /v1/traces)."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OTLPSink:
    def __init__(self) -> None:
        self.bodies: dict[str, list[bytes]] = {"/v1/metrics": [], "/v1/traces": []}
        self.content_types: set[str] = set()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                sink.content_types.add(self.headers.get("content-type", ""))
                sink.bodies.setdefault(self.path, []).append(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def metrics(self) -> list[ExportMetricsServiceRequest]:
        return [ExportMetricsServiceRequest.FromString(b) for b in list(self.bodies["/v1/metrics"])]

    def spans(self) -> list:
        out = []
        for b in list(self.bodies["/v1/traces"]):
            for rs in ExportTraceServiceRequest.FromString(b).resource_spans:
                for ss in rs.scope_spans:
                    out.extend(ss.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
