"""A fleetllm worker publishing its KV events in vLLM's format (``fleetllm worker --kv-events-config``), so a
router (or llm-d, or anything that reads vLLM's events) sees it as a vLLM worker.

The engine's own block hashes are fleetllm's; for each block entering the prefix cache this publisher computes
vLLM's hash (:class:`~fleetllm.router.backends.vllm_hash.VllmHasher`: the algorithm of
``--prefix-caching-hash-algo``, the root seed from ``PYTHONHASHSEED`` as vLLM takes it, the engine's block size)
chained on the parent block's, and remembers it until the block is evicted. A block a KV tier keeps (host
memory once the pool evicts it; the disk and shared tiers once a finished request's block is written) is
published again with the tier's medium (``"CPU"``, ``"DISK"``, ``"SHARED"``; the pool's is ``"GPU"``, as vLLM
names it), and removed with it when the tier drops it (:meth:`VllmEventPublisher.watch_tier`): its vLLM hash
is the one the pool's block had (remembered for the last :data:`RECENT` blocks evicted). Blocks a disk tier
found at start are not published in this format (their vLLM chain is unknown); fleetllm's own
``/kv/events`` reports them. Events are batched every 10 ms
(vLLM sends one batch per engine step) and sent as vLLM's ZMQ publisher does: ``(topic, seq, msgpack batch)``
on a PUB socket, with a replay ROUTER socket serving the last ``buffer_steps`` batches. Unlike vLLM, which
connects when the endpoint names no wildcard, this publisher always binds (the router subscribes by connecting).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import zmq

from fleetllm.engine.block_pool import BlockPool
from fleetllm.router.backends.vllm_hash import VllmHasher, external_hash
from fleetllm.router.backends.vllm_wire import END_SEQ, encode_batch, removed_event, stored_event

log = logging.getLogger(__name__)
RECENT = 1 << 16  # vLLM hashes of the blocks the pool evicted last, for a tier that stores them after


def offset_port(endpoint: str | None, i: int) -> str | None:
    """The endpoint of the ``i``-th of several publishers on one host (vLLM offsets data-parallel ranks so)."""
    if not endpoint or i == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + i}"


class VllmEventPublisher:
    """Publishes ``pool``'s stored / removed blocks as vLLM ``EventBatch`` messages on ``config``'s endpoints."""

    def __init__(self, pool: BlockPool, config: str | dict[str, Any], algo: str = "sha256",
                 seed: str | None = None, index: int = 0) -> None:
        cfg = json.loads(config) if isinstance(config, str) else dict(config)
        if cfg.get("publisher", "zmq") != "zmq":
            raise ValueError("fleetllm publishes KV events over zmq only")
        seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED")
        if seed is None:  # vLLM then draws a random root: no subscriber could reproduce the hashes
            raise ValueError("--kv-events-config needs PYTHONHASHSEED set (vLLM's block-hash root seed)")
        self.pool = pool
        self.hasher = VllmHasher(algo, seed, pool.block_size)
        self.endpoint = offset_port(cfg.get("endpoint", "tcp://*:5557"), index)
        self.replay_endpoint = offset_port(cfg.get("replay_endpoint"), index)
        self.topic = cfg.get("topic", "").encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=int(cfg.get("buffer_steps", 10_000)))
        self.digests: dict[int, bytes] = {}  # fleetllm hash -> vLLM digest, while the block is cached
        self.recent: OrderedDict[int, bytes] = OrderedDict()  # the pool's latest evictions (a tier may store them)
        self.tier_digests: dict[tuple[str, int], bytes] = {}  # (medium, hash) -> digest, while a tier holds it
        self.pending: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.seq = 0
        self.running = True
        self.bound = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-events-pub", daemon=True)

    def attach(self) -> VllmEventPublisher:
        """Hook onto the pool's events (keeping whoever listened before) and start publishing."""
        before: Callable[[str, list[int]], None] | None = self.pool.on_event

        def both(kind: str, hashes: list[int]) -> None:
            self.on_pool_event(kind, hashes)
            if before is not None:
                before(kind, hashes)

        self.pool.on_event = both
        self.thread.start()
        if not self.bound.wait(5.0):
            raise RuntimeError(f"KV-event publisher could not bind {self.endpoint}")
        return self

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=2.0)

    # ---- engine thread ----------------------------------------------------------------------------
    def on_pool_event(self, kind: str, hashes: list[int]) -> None:
        """Translate one pool event (called on the engine thread, while the pool is as the event says)."""
        if kind == "stored":
            for h in hashes:
                self._stored(h)
        elif kind == "removed":
            removed = {h: d for h in hashes if (d := self.digests.pop(h, None)) is not None}
            self.recent.update(removed)
            while len(self.recent) > RECENT:
                self.recent.popitem(last=False)
            gone = [external_hash(d) for d in removed.values()]
            if gone:
                with self.lock:
                    self.pending.append(removed_event(gone))

    def watch_tier(self, medium: str, listeners: list[Callable[[str, list[int], list[int]], None]]) -> None:
        """Publish the blocks a KV tier (whose ``listeners`` list is given) keeps and drops, as ``medium``."""
        listeners.append(lambda kind, hashes, token_ids: self.on_tier_event(medium, kind, hashes, token_ids))

    def on_tier_event(self, medium: str, kind: str, hashes: list[int], token_ids: list[int]) -> None:
        """A tier kept (``stored``) or dropped blocks; on the engine thread, or a tier's writer."""
        if kind == "stored":
            for h in hashes:  # a block the pool holds, or evicted lately
                digest = self.digests.get(h) or self.recent.get(h)
                if digest is not None:
                    self.tier_digests[(medium, h)] = digest
                    event = stored_event([external_hash(digest)], None, token_ids, self.pool.block_size, medium)
                    with self.lock:
                        self.pending.append(event)
            return
        gone = [external_hash(d) for d in (self.tier_digests.pop((medium, h), None) for h in hashes) if d]
        if gone:
            with self.lock:
                self.pending.append(removed_event(gone, medium))

    def _stored(self, h: int) -> None:
        b = self.pool.blocks[self.pool.cached[h]]
        parent = self.digests.get(b.parent) if b.parent is not None else None
        if b.parent is not None and parent is None:
            return  # its parent left the cache first: vLLM's chain for it cannot be computed
        assert b.token_ids is not None
        digest = self.hasher.digest(parent, b.token_ids, b.lora_name)
        self.digests[h] = digest
        ext, ext_parent = external_hash(digest), (external_hash(parent) if parent else None)
        with self.lock:
            last = self.pending[-1] if self.pending else None
            if (last is not None and last["type"] == "BlockStored" and last["block_hashes"][-1] == ext_parent
                    and last["lora_name"] == b.lora_name):
                last["block_hashes"].append(ext)  # one event per run of blocks, as vLLM sends them
                last["token_ids"].extend(b.token_ids)
            else:
                self.pending.append(stored_event([ext], ext_parent, list(b.token_ids), self.pool.block_size,
                                                 lora_name=b.lora_name))

    # ---- publisher thread -------------------------------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        try:
            pub.bind(self.endpoint)
            if self.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            log.error("KV-event publisher cannot bind: %s", e)
            pub.close()
            return
        self.bound.set()
        try:
            while self.running:
                if replay is not None and replay.poll(10):
                    self._serve_replay(replay)
                elif replay is None:
                    time.sleep(0.01)
                self._flush(pub)
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _flush(self, pub: zmq.Socket) -> None:
        with self.lock:
            events, self.pending = self.pending, []
        if not events:
            return
        payload = encode_batch(time.time(), events)
        pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
        self.buffer.append((self.seq, payload))
        self.seq += 1

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
