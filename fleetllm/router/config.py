"""The router's settings: each field a flag of ``fleetllm router`` (``fleetllm serve`` passes them on).

Torch-free, like the whole router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleetllm.cli_options import opt
from fleetllm.disagg.pd_auto import pd_threshold_value
from fleetllm.errors import UsageError
from fleetllm.router.pipeline.admission import FlowLimits
from fleetllm.router.policies import POLICY_NAMES, CostModel, scorer_weights
from fleetllm.router.state_url import state_url_value


@dataclass
class RouterConfig:
    """Routing, retries, health checks and the disaggregated (P/D) path."""

    workers: list[str] = opt(doc="comma-separated worker base URLs, e.g. http://127.0.0.1:8001; another engine as "
                                 "KIND+http://host:port, KIND one of fleetllm, vllm, sglang, tgi, llamacpp, openai "
                                 "(a plain URL's kind is detected; none: workers come from --discover or "
                                 "POST /admin/workers)", factory=list)
    discover: Literal["kubernetes"] | None = opt(None, "find workers while running: kubernetes (EndpointSlices; "
                                                       "the --k8s-* flags)")
    policy: str = opt("kv_aware", "routing policy", choices=POLICY_NAMES)
    zones: list[str] = opt(doc="comma-separated zone of each worker (metrics label; empty when unset)",
                           factory=list)
    roles: list[str] = opt(doc="comma-separated role of each worker (prefill|decode|both) until the worker's "
                               "own report says (default: both)", factory=list)
    pd_threshold: int | str = opt(4096, "disaggregate when the decode worker lacks at least this many prompt "
                                        "tokens; auto: when the P/D path is expected to delay requests less (the "
                                        "decode worker's stall against transfer and the prefill worker's queue)",
                                  parse=pd_threshold_value, metavar="TOKENS|auto")
    pd_timeout_s: float = opt(120.0, "seconds for a remote prefill + KV transfer; beyond it the request "
                                     "prefills locally")
    prefill_max_inflight: int = opt(2, "remote prefills that saturate a prefill worker")
    pd_transfer: Literal["auto", "shm", "http"] = opt("auto", "how KV blocks travel: shm (same host: written "
                                                             "straight into the decode worker's pool when it "
                                                             "shares it, else a frame in /dev/shm), http, or auto "
                                                             "(shm when both workers are on one host)")
    max_retries: int = opt(2, "retries on other workers before the first byte")
    health_interval_s: float = opt(1.0, "seconds between health checks")
    routed_ttl_s: float | None = opt(None, "seconds a routed prefix is remembered (default: 300 for prefix, "
                                           "10 for kv_aware)")
    session_header: str = opt("x-session-id", "header naming a session (else the body's `user`)")
    tokenizers: dict[str, str] = opt(doc="tokenizer for a served model name that is not itself a model "
                                         "reference", factory=dict, flag="--tokenizer", metavar="MODEL=REF")
    cost: CostModel = opt(doc="the cost model's rates (from --profile)", factory=CostModel, cli=False)
    kv_tier_load: dict[str, str] = opt(doc="kv_aware's price of loading a prefix block from a worker's KV tier "
                                           "(the medium its KV events name: CPU for host memory, DISK, SHARED "
                                           "for the Redis tier every worker reads), as a fraction of "
                                           "recomputing it, until the worker reports the load time it "
                                           "measured (default: CPU=0.05, DISK=0.15, SHARED=0.25)",
                                       factory=dict, metavar="MEDIUM=FRACTION")
    lora_load_cost_s: float = opt(CostModel.lora_load_s, "kv_aware's price, in seconds, of sending a LoRA adapter's "
                                                         "request to a copy not holding it resident (its load there, "
                                                         "and the adapter it evicts)")
    breaker_threshold: int = opt(3, "consecutive failures that open a worker's circuit breaker")
    breaker_cooldown_s: float = opt(5.0, "seconds a breaker stays open before one probe request")
    connect_timeout_s: float = opt(3.0, "seconds to connect to a worker")
    request_timeout_s: float = opt(600.0, "seconds for one forwarded request")
    seed: int | None = opt(None, "seed for random tie-breaks")
    models: list[str] = opt(doc="comma-separated served model of each worker until the worker's own report says",
                            factory=list, flag="--worker-models")
    variants: list[str] = opt(doc="comma-separated variant of each worker's model (for a traffic split)",
                              factory=list, flag="--worker-variants")
    traffic: dict[str, str] = opt(doc="split a model's requests between its variants by weight (sticky per "
                                      "session)", factory=dict, metavar="MODEL=VARIANT:WEIGHT,...")
    adapters: dict[str, str] = opt(doc="a LoRA adapter's name and its base model (NAME=BASE): routed to the base "
                                       "model's copies before any copy reports it (a fleet YAML's adapters)",
                                   factory=dict, flag="--adapter", metavar="NAME=BASE")
    aliases: dict[str, str] = opt(doc="another name clients may send for a served model", factory=dict,
                                  flag="--alias", metavar="ALIAS=MODEL")
    model_policies: dict[str, str] = opt(doc="a served model's own routing policy", factory=dict,
                                         flag="--model-policy", metavar="MODEL=POLICY")
    scale_from_zero: list[str] = opt(doc="comma-separated models whose requests are held while a copy starts",
                                     factory=list)
    hold_max_waiting: int = opt(64, "requests held per model while a copy starts; beyond, 503 + Retry-After")
    hold_timeout_s: float = opt(120.0, "seconds a request is held at most")
    responses_store: int = opt(4096, "Responses API turns remembered (previous_response_id -> the worker "
                                     "holding it, and the turn's items to re-send if it is gone)")
    keys_file: str | None = opt(None, "API keys file (fleetllm keys): only its keys may call /v1/*")
    admin_token_file: str | None = opt(None, "the admin token (Authorization: Bearer, for /admin/* and "
                                             "/router/state): read from this file, minted into it (mode 0600) "
                                             "when it does not exist; default: minted into a new private "
                                             "directory, its path printed")
    state_url: str | None = opt(None, "Redis server every router of the fleet shares (redis://[:PASSWORD@]HOST:PORT"
                                      "[/DB] or rediss://): the keys' limits hold across all of them; unreachable, "
                                      "this router limits alone until it is back (default: alone)",
                                parse=state_url_value, metavar="URL")
    state_namespace: str = opt("fleet", "this fleet's name in the shared state store: what names workers (the "
                                        "Responses API's turns) is kept apart from other fleets using the store")
    worker_ca_file: str | None = opt(None, "CA bundle (PEM) that signed the workers' certificates: https:// worker "
                                           "URLs are verified against it (default: the system's CAs)")
    kv_events_config: str | None = opt(None, "the vLLM workers' --kv-events-config JSON: the router subscribes to "
                                             "each vllm+ worker's publisher (a * bind address becomes its host)")
    kv_events_endpoints: dict[str, str] = opt(doc="one worker's KV-event endpoint in vLLM's format (overrides "
                                                  "--kv-events-config's; also a fleetllm worker publishing them)",
                                              factory=dict, flag="--kv-events-endpoint", metavar="URL=ENDPOINT")
    prefix_caching_hash_algo: str = opt("sha256", "the vLLM workers' --prefix-caching-hash-algo",
                                        choices=("sha256", "sha256_cbor"))
    hash_seed: str | None = opt(None, "the vLLM workers' PYTHONHASHSEED (default: this router's own); without one "
                                      "their block hashes cannot be reproduced")
    engine_block_size: int = opt(16, "the vLLM workers' --block-size")
    ray_address: str | None = opt(None, "also route to the fleet actors of this Ray cluster, found by name "
                                        "(auto or HOST:PORT; fleetllm serve --ray sets it)")
    ray_namespace: str = opt("fleetllm", "the Ray namespace of the fleet's actors")
    scorer_weights: dict[str, str] = opt(doc="the weight of one of prefix and kv_aware's cost scorers (queue, prefix, "
                                             "decode, kv_pressure, lora; default 1 each)", factory=dict,
                                         flag="--scorer-weight", metavar="NAME=WEIGHT")
    flow_control: bool = opt(False, "hold requests at the router until a copy of their model can start them (a "
                                    "free batch slot), queued per priority band and, within a band, per tenant (API key, else x-tenant-id or "
                                    "user) with weighted fair queuing; shed past --flow-queue-max or a request's "
                                    "deadline (off: requests go to the workers at once, first come first served)")
    flow_worker_queue: int | None = opt(FlowLimits.worker_queue, "requests a worker may hold waiting beyond those it "
                                                                 "can start now (a fleetllm worker: its free batch "
                                                                 "slots; another engine: at least 1 waiting); default "
                                                                 "1 at a fleetllm worker under --scheduling-policy "
                                                                 "priority (its next request starts as one ends), "
                                                                 "else 0", metavar="N")
    flow_headroom: float = opt(FlowLimits.headroom, "the fraction (0-1) of each fleetllm worker's batch slots that "
                                                    "the low band (priority > 0: Batch API lines) leaves free for "
                                                    "interactive requests (at least one slot when above 0)")
    flow_share_window_s: float = opt(FlowLimits.share_window_s, "seconds over which a tenant's batch slots held "
                                                                "are averaged: it is bulk work (leaves the headroom, "
                                                                "gives up its slots) while it holds its weighted "
                                                                "share both now and on that average (0: now alone)")
    flow_kv_usage: float = opt(FlowLimits.kv_usage, "KV-cache usage (0-1) that saturates a worker")
    flow_queue_max: int = opt(FlowLimits.queue_max, "requests waiting at the router per model; beyond, a lower "
                                                    "band's newest is shed (503), else the arrival (429)")
    flow_queue_timeout_s: float = opt(FlowLimits.timeout_s, "seconds a request waits at most unless its timeout "
                                                            "(x-request-timeout) says less; then 503")
    flow_aging_s: float = opt(FlowLimits.aging_s, "a waiting band's oldest request climbs one band per this many "
                                                  "seconds (no band starves)")
    batch_dir: str | None = opt(None, "where the Batch API keeps its files and batches, durable across a restart: a "
                                      "directory or s3://BUCKET[/PREFIX] (boto3's credentials and AWS_ENDPOINT_URL) "
                                      "(default: $XDG_STATE_HOME/fleetllm/batches, else ~/.local/state/fleetllm/"
                                      "batches); one per router: a router resumes every unfinished batch it finds "
                                      "there")
    batch_max_file_mb: float = opt(100.0, "largest batch input file in MiB; a larger upload gets a 400")
    batch_concurrency: int = opt(4, "batch lines in flight at once, all batches together (a small number: batches "
                                    "fill the fleet's idle capacity)")
    batch_max_active: int = opt(10, "unfinished batches per API key (with keys off, in all); beyond it a 429")
    batch_retention_h: float = opt(720.0, "hours files and ended batches are kept")
    batch_priority: int = opt(2**31 - 1, "the priority batch lines are sent at (fleetllm workers under "
                                         "--scheduling-policy priority serve larger numbers last)")

    def check(self) -> None:
        """UsageError (one line) for settings no router can run with: the scorer weights, the flow limits."""
        scorer_weights(self.scorer_weights)
        if (self.flow_worker_queue or 0) < 0 or self.flow_queue_max < 1:
            raise UsageError("--flow-worker-queue must be at least 0 and --flow-queue-max at least 1")
        if not 0 <= self.flow_headroom < 1:
            raise UsageError(f"--flow-headroom {self.flow_headroom:g}: a fraction of the batch slots, in [0, 1)")
        if not 0 < self.flow_kv_usage <= 1:
            raise UsageError(f"--flow-kv-usage {self.flow_kv_usage:g}: a fraction of the KV cache, in (0, 1]")
        if not self.flow_queue_timeout_s > 0 or not self.flow_aging_s >= 0 or not self.flow_share_window_s >= 0:
            raise UsageError("--flow-queue-timeout must be positive, --flow-aging and --flow-share-window at least 0")

    def flow_limits(self) -> FlowLimits:
        """The admission stage's limits (``--flow-*``)."""
        return FlowLimits(self.flow_worker_queue, self.flow_kv_usage, self.flow_queue_max, self.flow_queue_timeout_s,
                          self.flow_aging_s, self.flow_headroom, self.flow_share_window_s)
