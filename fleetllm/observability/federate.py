"""Many workers' Prometheus text re-exported as one page, each sample labelled with its worker.

The router serves ``/metrics`` = its own registry + :func:`federate` of its workers' pages, so a local
fleet is one scrape target. Families are merged by name (one HELP/TYPE each, all workers' samples
under it). A sample that already has a ``worker`` label with another value keeps it as
``exported_worker`` (Prometheus' rule for clashing target labels). A worker whose page could not be
read (``None``) is reported by ``fleetllm_federate_scrape_ok{worker} 0`` instead of silently vanishing.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping

import httpx

SCRAPE_OK = "fleetllm_federate_scrape_ok"


# One sample line of the text format: name, the labels' text inside the braces, the value and timestamp.
_VALUE = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|Inf|inf|NaN|nan)"
_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
                     rf'([ \t]+{_VALUE}(?:[ \t]+-?\d+)?)[ \t]*')
_WORKER = re.compile(r'(?:^|,)\s*worker\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')  # a page's own worker label

Family = tuple[str, str, list[str]]  # (type, HELP text as written, sample lines)


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _relabel(labels: str | None, worker: str) -> str:
    """The text inside a sample's braces with ``worker="<worker>"`` first; a different ``worker`` label the
    page already had is kept as ``exported_worker`` (Prometheus' rule for clashing target labels)."""
    own = f'worker="{_escape_label(worker)}"'
    if not labels or not labels.strip():
        return own
    m = _WORKER.search(labels)
    if m is None:
        return f"{own},{labels}"
    rest = (labels[:m.start()] + "," + labels[m.end():]).strip(", \t")
    clash = f',exported_worker="{m.group(1)}"' if m.group(1) != _escape_label(worker) else ""
    return f"{own},{rest}{clash}" if rest else own + clash


def _page_families(text: str, worker: str | None) -> dict[str, Family]:
    """One page's families, its samples relabelled; raises ValueError on a line that is not the text format."""
    families: dict[str, Family] = {}
    current: str | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                kind, doc, lines = families.setdefault(parts[2], ("untyped", "", []))
                value = parts[3] if len(parts) > 3 else ""
                families[parts[2]] = (value, doc, lines) if parts[1] == "TYPE" else (kind, value, lines)
                current = parts[2]
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {line[:80]!r}")
        name, labels, rest = m.groups()
        if current is None or not name.startswith(current.removesuffix("_total")):
            current = name  # a sample with no family header of its own
        fam = families.setdefault(current, ("untyped", "", []))
        fam[2].append(line if worker is None else f"{name}{{{_relabel(labels, worker)}}}{rest}")
    return families


def federate(texts: Mapping[str, str | None], local: str | None = None) -> str:
    """Merge ``{worker name: its /metrics text (None if unreadable)}`` into one Prometheus text page,
    adding ``worker=<name>`` to every sample; ``local`` (e.g. the router's own page) is merged as is.

    Works on the text lines (a fleet of 32 workers is ~10k lines a scrape): families are merged by the name
    their HELP/TYPE lines give, samples keep the worker's own formatting with the label added.
    """
    families: dict[str, Family] = {}

    def merge(page: dict[str, Family]) -> None:
        for name, (kind, doc, lines) in page.items():
            have = families.setdefault(name, (kind, doc, []))
            if have[0] == kind:  # the same name with another type cannot share a family: keep the first
                have[2].extend(lines)

    if local:
        merge(_page_families(local, None))
    ok_lines = []
    for worker, text in texts.items():
        if text is not None:
            try:
                merge(_page_families(text, worker))
            except ValueError:  # a page that does not parse counts as unreadable
                text = None
        ok_lines.append(f'{SCRAPE_OK}{{worker="{_escape_label(worker)}"}} {0.0 if text is None else 1.0}')
    out = []
    for name, (kind, doc, lines) in families.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *lines]
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
