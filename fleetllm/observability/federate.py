"""Many workers' Prometheus text re-exported as one page, each sample labelled with its worker.

The router serves ``/metrics`` = its own registry + :func:`federate` of its workers' pages, so a local
fleet is one scrape target. Families are merged by name (one HELP/TYPE each, all workers' samples
under it). A sample that already has a ``worker`` label with another value keeps it as
``exported_worker`` (Prometheus' rule for clashing target labels). A worker whose page could not be
read (``None``) is reported by ``fleetllm_federate_scrape_ok{worker} 0`` instead of silently vanishing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

SCRAPE_OK = "fleetllm_federate_scrape_ok"


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _sample_line(name: str, labels: Mapping[str, str], value: float) -> str:
    if not labels:
        return f"{name} {floatToGoString(value)}"
    body = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
    return f"{name}{{{body}}} {floatToGoString(value)}"


def federate(texts: Mapping[str, str | None], local: str | None = None) -> str:
    """Merge ``{worker name: its /metrics text (None if unreadable)}`` into one Prometheus text page,
    adding ``worker=<name>`` to every sample; ``local`` (e.g. the router's own page) is merged as is."""
    families: dict[str, tuple[str, str, list[str]]] = {}  # name -> (type, help, sample lines)

    def add(text: str, worker: str | None) -> None:
        for fam in text_string_to_metric_families(text):
            kind, _, lines = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            if kind != fam.type:
                continue  # the same name with another type cannot share a family: keep the first
            for s in fam.samples:
                labels = dict(s.labels)
                if worker is not None:
                    own = labels.pop("worker", None)
                    labels = {"worker": worker, **labels}
                    if own is not None and own != worker:
                        labels["exported_worker"] = own
                lines.append(_sample_line(s.name, labels, s.value))

    if local:
        add(local, None)
    ok_lines = []
    for worker, text in texts.items():
        if text is not None:
            try:
                add(text, worker)
            except ValueError:  # a page that does not parse counts as unreadable
                text = None
        ok_lines.append(_sample_line(SCRAPE_OK, {"worker": worker}, 0.0 if text is None else 1.0))
    out = []
    for name, (kind, doc, lines) in families.items():
        head = name + "_total" if kind == "counter" else name  # as prometheus_client writes (and parses) it
        out += [f"# HELP {head} {_escape_help(doc)}", f"# TYPE {head} {kind}", *lines]
    if texts:
        out += [f"# HELP {SCRAPE_OK} Whether the worker's /metrics was read for this page (1) or not (0).",
                f"# TYPE {SCRAPE_OK} gauge", *ok_lines]
    return "\n".join(out) + "\n"


async def scrape_workers(workers: Mapping[str, str], client: httpx.AsyncClient,
                         timeout_s: float = 2.0) -> dict[str, str | None]:
    """``{name: base URL}`` -> ``{name: /metrics text or None}``, all read concurrently."""

    async def one(url: str) -> str | None:
        try:
            r = await client.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
            return r.text if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    texts = await asyncio.gather(*(one(u) for u in workers.values()))
    return dict(zip(workers, texts, strict=True))


async def fleet_metrics(local: str, workers: Mapping[str, str], client: httpx.AsyncClient) -> str:
    """The router's ``/metrics`` page: its own registry's text (``local``) plus every worker's page
    (``{name: base URL}``), read concurrently and labelled ``worker=<name>``."""
    texts = await scrape_workers(workers, client)
    return await asyncio.to_thread(federate, texts, local)  # parsing N pages is CPU work: off the event loop
