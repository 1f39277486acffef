"""Observability shared by workers and the router: process/host metrics and cold-start phases
(:mod:`.process`), OTLP export of a Prometheus registry (:mod:`.otlp`), request tracing
(:mod:`.tracing`), re-export of many workers' metrics on one page (:mod:`.federate`) and the live
dashboard (:mod:`.dashboard`).

Prometheus text at ``/metrics`` is the one source: OTLP metrics, federation and the dashboard all
read it, so every view shows the same numbers.
"""
