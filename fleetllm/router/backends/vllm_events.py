"""The router's subscription to a vLLM worker's KV events (ZMQ PUB, optionally a ROUTER replay socket).

vLLM has no snapshot of its cache, only a replay buffer of recent batches, so the subscriber replays from
sequence 0 when it connects (and after the worker was out of rotation: its entries were dropped), skips the
replayed batches the live stream repeats, asks for a replay when it sees a gap, and treats a sequence number
going backwards as a restarted worker (its entries dropped, the new process' events applied from there).
Without a replay endpoint, what happened before the subscription or inside a gap stays unknown; the index's
routed hints still cover prompts the router sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from fleetllm.router.backends.vllm_wire import CLEARED, END_SEQ, STORED, KVEvent, decode_batch
from fleetllm.router.index import PrefixIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventSource:
    """Where a worker publishes: vLLM's ``--kv-events-config`` ``endpoint``, ``topic`` and ``replay_endpoint``."""

    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None


def source_from_config(config: str | dict, host: str) -> EventSource:
    """The subscriber's side of a worker's ``--kv-events-config``: a wildcard bind address (``tcp://*:5557``)
    becomes the worker's host."""
    cfg = json.loads(config) if isinstance(config, str) else config
    if cfg.get("publisher", "zmq") != "zmq":
        raise ValueError(f"only the zmq KV-event publisher can be subscribed to, not {cfg.get('publisher')!r}")

    def at_host(ep: str | None) -> str | None:
        if not ep:
            return None
        for wildcard in ("*", "0.0.0.0", "[::]"):
            ep = ep.replace(f"//{wildcard}:", f"//{host}:")
        return ep

    endpoint = at_host(cfg.get("endpoint", "tcp://*:5557"))
    assert endpoint is not None
    return EventSource(endpoint, cfg.get("topic", ""), at_host(cfg.get("replay_endpoint")))


class VllmEventSubscriber:
    """Keeps ``index``'s exact entries for worker ``name`` equal to what its vLLM events say it caches."""

    def __init__(self, name: str, source: EventSource, index: PrefixIndex,
                 on_event: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.source = source
        self.index = index
        self.on_event = on_event  # the first batch marks the worker's events as connected
        self.last: int | None = None  # the last sequence number applied
        self.skip_until: int | None = None  # after a replay: live batches up to here are repeats
        self.resync = True  # replay from 0 before the next live batch
        self.ctx = zmq.asyncio.Context.instance()

    def forget(self) -> None:
        """The worker's entries were dropped (it went down): rebuild them from the replay buffer."""
        self.resync = True

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        try:
            while True:
                if self.resync and self.source.replay_endpoint:
                    self.index.reset(self.name, [])
                    self.last = None
                    await self._replay(0)
                self.resync = False
                if not await sub.poll(1000):
                    continue
                frames = await sub.recv_multipart()
                if len(frames) == 3:
                    await self._live(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close()

    async def _live(self, seq: int, payload: bytes) -> None:
        if self.skip_until is not None:
            if seq <= self.skip_until:
                return
            self.skip_until = None
        if self.last is not None and seq <= self.last:
            log.info("vLLM worker %s restarted (event sequence back to %d): index re-synced", self.name, seq)
            self.index.reset(self.name, [])
        elif self.last is not None and seq > self.last + 1 and self.source.replay_endpoint:
            await self._replay(self.last + 1)
            if self.last is not None and seq <= self.last:
                return
        self.apply(payload)
        self.last = seq

    async def _replay(self, start: int) -> None:
        """Apply every buffered batch from ``start`` on (the publisher answers until its end marker)."""
        assert self.source.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while await dealer.poll(2000):
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or frames[1] == END_SEQ:
                    break
                seq = int.from_bytes(frames[1], "big")
                if self.last is None or seq > self.last:
                    self.apply(frames[2])
                    self.last = seq
            self.skip_until = self.last
        finally:
            dealer.close()

    def apply(self, payload: bytes) -> None:
        try:
            _, events = decode_batch(payload)
        except (ValueError, TypeError, KeyError, IndexError) as e:  # msgpack's errors are ValueErrors
            log.warning("undecodable KV-event batch from %s: %s", self.name, e)
            return
        for ev in events:
            apply_event(self.index, self.name, ev)
        self.on_event()


def apply_event(index: PrefixIndex, worker: str, ev: KVEvent) -> None:
    if ev.kind == STORED:
        index.stored(worker, ev.hashes)
    elif ev.kind == CLEARED:
        index.reset(worker, [])
    else:
        index.removed(worker, ev.hashes)


async def run_forever(sub: VllmEventSubscriber) -> None:
    """``sub.run`` restarted after an unexpected error (a subscription must outlive a bad moment)."""
    while True:
        try:
            await sub.run()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - logged, retried
            log.warning("KV events of %s: %s", sub.name, e)
            await asyncio.sleep(1.0)
