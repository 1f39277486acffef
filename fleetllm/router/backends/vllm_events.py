"""The router's subscription to a vLLM worker's KV events (ZMQ PUB, optionally a ROUTER replay socket).

vLLM has no snapshot of its cache, only a replay buffer of recent batches, so with a replay endpoint the
subscriber keeps the worker's exact entries equal to what the worker published by these rules:

- it rebuilds them from the replay buffer (from sequence 0) when it starts and after the worker was out of
  rotation (the router dropped its entries then), swapping the rebuilt set in whole;
- a live batch whose sequence number skips ahead is a gap: the missing batches are fetched first, in order;
- a PUB socket drops what it sends before a subscriber's subscription has reached it (ZMQ's slow joiner: at
  start, and again after every reconnect) and beyond its high-water mark, and a lost batch shows as a gap
  only when a later one arrives. So after the subscription (re)connects and after live batches, the first
  idle second asks the replay socket for anything after the last batch applied: a lost last batch is found
  too. An empty but complete replay means nothing was published yet, so the first batch must be 0;
- a sequence number going backwards (outside the batches a replay just brought) is a restarted worker: its
  entries are dropped and the new process' batches applied from its first;
- a replay that does not answer to its end marker within ``REPLAY_TIMEOUT_S`` changes nothing it did not
  bring; if a live batch had to be applied over a gap meanwhile, the next idle second rebuilds everything.

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


REPLAY_TIMEOUT_S = 5.0  # a replay's answer may wait for the worker's busy publisher thread
IDLE_S = 1.0  # no live batch for this long: the stream is idle (time to confirm it lost nothing)


class VllmEventSubscriber:
    """Keeps ``index``'s exact entries for worker ``name`` equal to what its vLLM events say it caches."""

    def __init__(self, name: str, source: EventSource, index: PrefixIndex,
                 on_event: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.source = source
        self.index = index
        self.on_event = on_event  # connected: the subscription's handshake, or a batch, marks the worker so
        self.last: int | None = None  # the last sequence number applied; -1: the worker had published none
        self.repeats: tuple[int, int] | None = None  # batches a replay brought that the live stream may repeat
        self.resync = True  # rebuild from the replay buffer before the next live batch
        self.unconfirmed = True  # a batch may have been lost since the replay socket last answered in full
        self.holes = False  # a live batch was applied over a gap the replay could not fill
        self.replay_failing = False  # the last replay did not answer in full
        self.ctx = zmq.asyncio.Context.instance()

    def forget(self) -> None:
        """The worker's entries were dropped (it went down): rebuild them from the replay buffer."""
        self.resync = True

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        joins = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # each (re)connect: a slow-joiner window
        sub.connect(self.source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(joins, zmq.POLLIN)
        try:
            while True:
                if self.resync:
                    await self._resync()
                ready = dict(await poller.poll(IDLE_S * 1000))
                if joins in ready:
                    await joins.recv_multipart()
                    self.unconfirmed = True
                    self.on_event()  # connected even if the worker has published nothing yet
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) == 3:
                        await self._live(int.from_bytes(frames[1], "big"), frames[2])
                elif not ready and self.source.replay_endpoint and (self.holes or self.unconfirmed):
                    await (self._resync() if self.holes else self._catch_up())
        finally:
            sub.disable_monitor()
            joins.close()
            sub.close()

    async def _live(self, seq: int, payload: bytes) -> None:
        if self.repeats is not None and self.repeats[0] <= seq <= self.repeats[1]:
            return  # a replay brought it already
        self.repeats = None
        if self.last is not None and seq <= self.last:
            log.info("vLLM worker %s restarted (event sequence back to %d): index re-synced", self.name, seq)
            self.index.reset(self.name, [])
            self.last = None
        if self.source.replay_endpoint and (self.last is None or seq > self.last + 1):
            await self._catch_up()  # what came before this batch (all of it at the start or after a restart)
            if self.repeats is not None and self.repeats[0] <= seq <= self.repeats[1]:
                return
            if self.last is None or seq > self.last + 1:
                self.holes = True  # the replay did not answer: applied anyway, rebuilt when idle
        self.apply(payload)
        self.last = seq
        self.unconfirmed = True  # confirmed at the next idle moment (a lost batch after this one shows no gap)

    async def _resync(self) -> None:
        """Rebuild the worker's entries from everything the replay buffer holds, swapped in at once."""
        self.resync = False  # a forget() during the replay asks for another
        if not self.source.replay_endpoint:
            self.last = None
            return
        batches, complete = await self._fetch(0)
        if not complete:
            self.holes = True  # keep what we have; the next idle moment tries again
            return
        self.index.reset(self.name, [])
        self.last, self.repeats = -1, None  # a complete replay: nothing published beyond what it brought
        self._apply_replayed(batches)
        self.holes = self.unconfirmed = False

    async def _catch_up(self) -> None:
        """Apply the buffered batches after the last one applied (all of them when none was)."""
        batches, complete = await self._fetch(0 if self.last is None else self.last + 1)
        self._apply_replayed(batches)
        self.unconfirmed = not complete
        if complete and self.last is None:
            self.last = -1  # nothing published yet: the first live batch must be 0, anything later is a gap

    def _apply_replayed(self, batches: list[tuple[int, bytes]]) -> None:
        fresh = [(seq, payload) for seq, payload in batches if self.last is None or seq > self.last]
        for seq, payload in fresh:
            self.apply(payload)
            self.last = seq
        if fresh:
            self.repeats = (fresh[0][0], fresh[-1][0])

    async def _fetch(self, start: int) -> tuple[list[tuple[int, bytes]], bool]:
        """The publisher's buffered batches from ``start`` on, and whether its end marker came."""
        assert self.source.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay_endpoint)
        batches: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or frames[1] == END_SEQ:
                    self.replay_failing = False
                    return batches, True
                batches.append((int.from_bytes(frames[1], "big"), frames[2]))
            if not self.replay_failing:  # once per streak: a worker that is down fails every idle second
                log.warning("the replay socket of %s did not answer within %gs", self.name, REPLAY_TIMEOUT_S)
            self.replay_failing = True
            return batches, False
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
    """Apply one decoded event to ``worker``'s entries (a block's medium says its pool or which KV tier)."""
    if ev.kind == STORED:
        index.stored(worker, ev.hashes, ev.medium)
    elif ev.kind == CLEARED:
        index.reset(worker, [])
    else:
        index.removed(worker, ev.hashes, ev.medium)


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
