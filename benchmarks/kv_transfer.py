"""KV transfer for disaggregated prefill/decode, before (main) and after (this checkout), in one run (issue #21).

1. **Transfer**: one 2048-token prompt's frame (128 blocks x 30 layers of K and V, SmolLM2-135M) shipped into
   a real decode worker over shared memory and over HTTP, against a memory copy of the same bytes (into
   memory already touched: the fastest copy; ``clone`` into fresh memory, as the earlier figure used, also
   shown). *before*: main's worker and sender (frame encoded, written to a new /dev/shm file, read back,
   decoded, imported on the engine thread). *after*: the frame already built in a reused shared-memory
   buffer (the prefill fills it layer by layer while it computes), mapped and imported in place; also
   shown with building the frame included (nothing overlapped). *after*, **pool**: the direct write
   (``fleetllm/disagg/direct.py``): blocks reserved in the decode worker's shared pool, each layer written
   into them (what the prefill does while it computes), then the commit. Exposed: the commit's round trip
   (nothing is left to copy or check); the reservation (as the prefill starts: a prompt longer than one step's
   token budget computes its first chunk meanwhile) and the writes (during it) are shown as their own rows.
2. **TTFT**: a prefill worker and a decode worker (one torch thread each, pinned to cores 0 and 1 where the
   machine has two, then to 1 and 0: every figure per layout, and the ratios' geometric mean over both, in
   which each core's speed counts once on either side) behind a router disaggregating every prompt of >=
   1024 uncached tokens. Fresh
   2048-token prompts, in turn straight to the decode worker (local prefill), through the router (remote
   prefill + transfer) and through a second router in front of the decode worker alone (local prefill with
   the router's hop, as a fleet without P/D serves it), 1 output token, streamed; each round starts with the
   next path (no path always first), and each round's remote/local ratio is reported too.
   ``--control-pairs N``: N more pairs prefilled locally on each worker, no P/D: how far two identical
   workers differ on this machine (the noise the remote/local ratio sits in).
3. **Quality**: greedy outputs after importing fp32, fp16 and bf16 frames of an fp32 pool vs a local prefill.

    python benchmarks/kv_transfer.py --before /work/main        # before and after (BENCHMARKS.md)
    python benchmarks/kv_transfer.py --quick                     # after only, fewer repeats
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from statistics import median
from types import ModuleType

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import admin_token, cpu_model, free_ports, stop_process  # noqa: E402

from fleetllm.disagg import frame  # noqa: E402
from fleetllm.disagg.buffers import FrameBuffers  # noqa: E402
from fleetllm.disagg.direct import PoolTarget  # noqa: E402
from fleetllm.disagg.routes import SHM_DIR  # noqa: E402
from fleetllm.disagg.shared_pool import PoolLayout, PoolMaps  # noqa: E402
from fleetllm.engine.block_pool import hash_prefix_blocks  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
POOL_BYTES = 1 << 30  # the worker's KV pool (--kv-cache-gb 1, the default)


def start(args: list[str], url: str, pythonpath: Path, log: Path) -> subprocess.Popen[bytes]:
    """``fleetllm ARGS`` with ``pythonpath``'s fleetllm, once ``url`` answers /health."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "PYTHONUNBUFFERED": "1"}
    # cwd too: ``python -m`` puts the working directory first on sys.path
    p = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", *args], env=env, stdout=log.open("wb"),
                         stderr=subprocess.STDOUT, cwd=pythonpath)
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            raise RuntimeError(f"{args[0]} exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy")


# (prefill worker's core, decode worker's core): each TTFT path is measured on both assignments, so that a core
# faster than the other (measured: up to 2.4%, by the control below) favours neither path
LAYOUTS = {"prefill on core 0, decode on 1": (0, 1), "prefill on core 1, decode on 0": (1, 0)}


def worker(port: int, role: str, pythonpath: Path, log_dir: Path, core: int) -> subprocess.Popen[bytes]:
    # main refuses request bodies over 16 MiB, KV frames too: raised so that its HTTP path can be measured
    pin = ["--cpus", str(core)] if (os.cpu_count() or 1) >= 2 else []
    return start(["worker", "--port", str(port), "--role", role, "--num-threads", "1", "--log-level", "warning", *pin,
                  "--kv-cache-gb", str(POOL_BYTES / (1 << 30)),
                  "--max-body-bytes", str(1 << 30)],
                 f"http://127.0.0.1:{port}", pythonpath, log_dir / f"worker-{port}.log")


def fresh_frame(seed: int, blocks: int) -> tuple[frame.FrameHeader, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A frame of ``blocks`` blocks no worker holds yet (tokens from ``seed``), random K and V."""
    rng = random.Random(seed)
    tokens = [rng.randrange(100, 40000) for _ in range(blocks * 16)]
    header = frame.FrameHeader(MODEL, 30, 3, 64, "float32", 16, tokens, hash_prefix_blocks(tokens, 16, MODEL.encode()))
    return header, [(torch.randn(blocks, 16, 3, 64), torch.randn(blocks, 16, 3, 64)) for _ in range(30)]


CLIENT = httpx.Client(timeout=300)  # one connection: a new client per call costs more than the transfer


def post_kv(url: str, **kw: object) -> dict:
    r = CLIENT.post(url + "/pd/kv", **kw)
    assert r.status_code == 200 and r.json()["imported"] > 0, r.text
    return r.json()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def transfer(url: str, repeats: int, blocks: int, checkout: Path | None, seed: int) -> dict[str, list[float]]:
    """Seconds per frame into the worker at ``url``: this checkout's way, or (``checkout``: main's) main's way,
    its frames encoded by main's own frame module (the format changed: CRC-32 then, CRC-32C now).

    The worker's KV pool is filled once first (its pages touched), as in a worker that has been serving a
    while: a frame imported into pages never touched pays a page fault per 4 KiB, more than the copy itself
    (shown once, as its own row, for this checkout)."""
    out: dict[str, list[float]] = {}
    buffers = FrameBuffers(SHM_DIR)
    new, fmt = checkout is None, frame if checkout is None else frame_module(checkout)

    def encode(header: frame.FrameHeader, layers: list) -> bytes:
        return b"".join(fmt.encode(fmt.FrameHeader(**dataclasses.asdict(header)), layers))

    maps = PoolMaps()
    if new:
        header, layers = fresh_frame(seed - 1, blocks)
        out["shm (exposed), pool pages never touched"] = [ship_shm(url, buffers, header, layers)[0]]
        pool = ship_pool(url, maps, *fresh_frame(seed - 2, blocks))
        out["pool pages mapped, pool pages never touched"] = [pool["prefault"]]
        out["pool writes (during the prefill), pool pages never touched"] = [pool["write"]]
    for w in range(POOL_BYTES // fresh_frame(0, blocks)[0].frame_bytes() + 2):  # every pool block written once
        data = encode(*fresh_frame(seed + 1000 + w, blocks))
        post_kv(url, content=data, headers={"content-type": "application/octet-stream"})
    for r in range(repeats):
        header, layers = fresh_frame(seed + 2 * r, blocks)
        data = encode(header, layers)
        out.setdefault("http", []).append(timed(lambda d=data: post_kv(url, content=d, headers={
            "content-type": "application/octet-stream"})))
        header, layers = fresh_frame(seed + 2 * r + 1, blocks)
        if not new:  # main: encode, a new file in /dev/shm, the receiver reads, decodes and unlinks it
            data = encode(header, layers)
            path = SHM_DIR / f"fleetllm-kv-{uuid.uuid4().hex}"
            out.setdefault("shm", []).append(timed(lambda p=path, d=data: (p.write_bytes(d), post_kv(url, json={"shm": str(p)}))))
            continue
        exposed, whole = ship_shm(url, buffers, header, layers)
        out.setdefault("shm (exposed)", []).append(exposed)  # the frame was built while the prefill computed
        out.setdefault("shm incl. building the frame", []).append(whole)
        pool = ship_pool(url, maps, *fresh_frame(seed + 10_000 + r, blocks))
        out.setdefault("pool (exposed: commit)", []).append(pool["commit"])  # written while the prefill computed
        out.setdefault("pool reservation (as the prefill starts)", []).append(pool["reserve"])
        out.setdefault("pool pages mapped (a spare thread, as the prefill starts)", []).append(pool["prefault"])
        out.setdefault("pool writes (during the prefill)", []).append(pool["write"])
        out.setdefault("pool incl. reservation, mapping and writes", []).append(sum(pool.values()))
    return out


def frame_module(checkout: Path) -> ModuleType:
    """``fleetllm.disagg.frame`` as ``checkout`` has it (it needs only torch and the standard library)."""
    spec = importlib.util.spec_from_file_location("before_frame", checkout / "fleetllm/disagg/frame.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["before_frame"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def ship_shm(url: str, buffers: FrameBuffers, header: frame.FrameHeader, layers: list) -> tuple[float, float]:
    """This checkout's shared-memory transfer of one frame: seconds exposed (the frame already built in a
    reused buffer) and seconds including building it."""
    buf = buffers.take("shm", header.frame_bytes())
    t0 = time.perf_counter()
    fb = frame.FrameBuffer(header, buf.memory)  # what the layer stream does during the prefill
    for i, (k, v) in enumerate(layers):
        fb.layer(i)[0].copy_(k)
        fb.layer(i)[1].copy_(v)
        fb.seal(i)
    fb.finish()
    t1 = time.perf_counter()
    post_kv(url, json={"shm": str(buf.path), "bytes": fb.size, "keep": True})
    t2 = time.perf_counter()
    buffers.give_back(buf, reusable=True)
    return t2 - t1, t2 - t0


def ship_pool(url: str, maps: PoolMaps, header: frame.FrameHeader, layers: list) -> dict[str, float]:
    """This checkout's direct write of one prompt's blocks into the decode worker's shared pool: seconds to
    reserve, to map the blocks' pages (a spare thread, as the prefill starts), to write every layer (what the
    layer stream does during the prefill, on the engine thread), and to commit."""
    t0 = time.perf_counter()
    r = CLIENT.post(url + "/pd/reserve", json={"header": header.to_json(), "lease_s": 60})
    assert r.status_code == 200, r.text
    lease = r.json()
    layout = PoolLayout.parse(lease["pool"])
    target = PoolTarget(header, maps.layers(layout), lease["blocks"], time.monotonic() + 60)
    t1 = time.perf_counter()
    maps.prefault(layout, lease["blocks"])  # a worker does this on a spare thread as the prefill starts
    tp = time.perf_counter()
    index = torch.arange(header.num_blocks)
    for i, (k, v) in enumerate(layers):
        target.put(i, 0, k, v, index)
    t2 = time.perf_counter()
    r = CLIENT.post(url + "/pd/commit", json={"lease": lease["lease"]})
    assert r.status_code == 200 and r.json()["imported"] == header.num_blocks, r.text
    return {"reserve": t1 - t0, "prefault": tp - t1, "write": t2 - tp, "commit": time.perf_counter() - t2}


def memcpy(nbytes: int, repeats: int) -> dict[str, list[float]]:
    src = torch.frombuffer(bytearray(os.urandom(1 << 20)) * (nbytes >> 20), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touched once: what follows is the copy alone
    return {"memcpy": [timed(lambda: dst.copy_(src)) for _ in range(repeats)],
            "memcpy into fresh memory (clone)": [timed(src.clone) for _ in range(repeats)]}


def ttft(urls: dict[str, str], tokens: int, repeats: int, seed: int) -> dict[str, list[float]]:
    """Client-side TTFT (s) of fresh prompts sent to each of ``urls`` (name -> base URL) in turn, ``repeats``
    rounds: e.g. a local prefill on the decode worker against a remote one through the router."""
    rng = random.Random(seed)
    out: dict[str, list[float]] = {name: [] for name in urls}
    names = list(urls)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:  # each path first in turn
            url = urls[name]
            prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        out[name].append(time.perf_counter() - t0)
                        break
    return out


def pd_decisions(router_url: str) -> dict[str, float]:
    d = {}
    for line in httpx.get(router_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("fleetllm_router_pd_decisions_total{"):
            d[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return d


def sent_via(prefill_url: str) -> dict[str, float]:
    """MB the prefill worker sent, by way (http, shm frames; pool: written into the decode worker's pool)."""
    out: dict[str, float] = {}
    for line in httpx.get(prefill_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("fleetllm:kv_transfer_bytes_total{") and 'direction="sent"' in line:
            via = line.split('via="', 1)[1].split('"', 1)[0]
            out[via] = round(float(line.rsplit(" ", 1)[1]) / 1e6, 1)
    return out


def router_ready(url: str, admin: dict[str, str]) -> None:
    for _ in range(300):
        s = httpx.get(url + "/router/state", headers=admin, timeout=5).json()
        if all(w["healthy"] and w["events_connected"] for w in s["workers"]):
            return
        time.sleep(0.2)
    raise RuntimeError(f"router never saw its workers: {s}")


def run_version(name: str, checkout: Path, args: argparse.Namespace, log_dir: Path) -> dict:
    """Transfer and TTFT figures of the fleetllm in ``checkout`` (TTFT: on each core layout)."""
    res: dict = {"ttft": {}, "control": {}, "pd_decisions": {}, "sent_via": {}}
    for i, (layout, cores) in enumerate(LAYOUTS.items()):
        run_layout(name, checkout, args, log_dir, layout, cores, res, with_transfer=i == 0)
    return res


def run_layout(name: str, checkout: Path, args: argparse.Namespace, log_dir: Path, layout: str,
               cores: tuple[int, int], res: dict, with_transfer: bool) -> None:
    """One core layout's figures into ``res`` (with_transfer: the transfer's too)."""
    # each port picked just before its process binds it: picked together, the later ones could be taken meanwhile
    # by the earlier processes' own outgoing connections (ephemeral ports)
    d_port = free_ports(1)
    d_url = f"http://127.0.0.1:{d_port}"
    procs = [worker(d_port, "decode", checkout, log_dir, cores[1])]
    try:
        if with_transfer:
            res["transfer"] = transfer(d_url, args.repeats, args.tokens // 16, None if name == "after" else checkout,
                                       100 if name == "before" else 200)
        p_port = free_ports(1)
        p_url = f"http://127.0.0.1:{p_port}"
        procs.append(worker(p_port, "prefill", checkout, log_dir, cores[0]))
        r_port = free_ports(1)
        r_url = f"http://127.0.0.1:{r_port}"
        # a checkout from before the admin token had open admin endpoints and no such flag
        token, admin = admin_token(log_dir) if "admin_token_file" in (
            checkout / "fleetllm/router/config.py").read_text() else ([], {})
        procs.append(start(["router", "--port", str(r_port), "--workers", f"{p_url},{d_url}", "--pd-threshold",
                            "1024", "--log-level", "warning", *token], r_url, checkout, log_dir / f"router-{name}.log"))
        # the same decode worker behind a router of its own, no P/D: what the router's hop costs a local prefill
        l_port = free_ports(1)
        l_url = f"http://127.0.0.1:{l_port}"
        procs.append(start(["router", "--port", str(l_port), "--workers", d_url, "--log-level", "warning", *token],
                           l_url, checkout, log_dir / f"router-local-{name}.log"))
        router_ready(r_url, admin)
        router_ready(l_url, admin)
        res["ttft"][layout] = ttft({"local prefill": d_url, "remote prefill": r_url, "local prefill via router": l_url},
                                   args.tokens, args.ttft_repeats, 7 + len(name) + cores[0])
        if args.control_pairs:  # the same local prefill on both workers: how far two identical workers differ here
            res["control"][layout] = ttft({"decode worker": d_url, "prefill worker": p_url}, args.tokens,
                                          args.control_pairs, 3 + cores[0])
        res["pd_decisions"][layout] = pd_decisions(r_url)
        res["sent_via"][layout] = sent_via(p_url)
    finally:
        for p in reversed(procs):
            stop_process(p)


def quality(prompts: int, out_tokens: int) -> dict[str, dict[str, float]]:
    """Greedy tokens after importing a frame in each wire dtype into an fp32 pool, against a local prefill."""
    from fleetllm.disagg.kv_io import export_blocks, import_blocks
    from fleetllm.engine.engine import EngineConfig, LLMEngine
    from fleetllm.engine.params import SamplingParams
    from fleetllm.models.loader import load_model

    loaded = load_model(MODEL)
    src = LLMEngine(EngineConfig(num_blocks=1024), loaded=loaded)
    dst = LLMEngine(EngineConfig(num_blocks=1024), loaded=loaded)  # fresh prompts: nothing of them cached here
    rng = random.Random(5)
    words = "the a system cache token worker prompt layer block engine router fleet request model".split()
    res: dict[str, dict[str, float]] = {}
    for dtype in ("float32", "float16", "bfloat16"):
        same, first_diff = 0, []
        for i in range(prompts):
            ids = src.tokenizer.encode(f"{dtype} {i}: " + " ".join(rng.choice(words) for _ in range(150)))
            local = generate(src, f"l{dtype}{i}", ids, out_tokens, SamplingParams)
            import_blocks(dst, *frame.decode(b"".join(frame.encode(*export_blocks(src, ids, dtype)))))
            remote = generate(dst, f"r{dtype}{i}", ids, out_tokens, SamplingParams)
            same += remote == local
            first_diff.append(next((j for j, (x, y) in enumerate(zip(local, remote, strict=True)) if x != y), out_tokens))
        res[dtype] = {"identical": same, "prompts": prompts, "first_divergence_median": median(first_diff)}
    return res


def generate(engine, rid: str, ids: list[int], n: int, params_cls) -> list[int]:  # noqa: ANN001
    engine.add_request(rid, ids, params_cls(max_tokens=n, temperature=0.0, ignore_eos=True))
    toks: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            toks += o.new_token_ids
    return toks


def report(results: dict, nbytes: int, q: dict) -> list[str]:
    copy = median(results["memcpy"]["memcpy"])
    lines = ["| what | via | median s | GB/s | % of memcpy |", "|---|---|---|---|---|"]
    for what, times in results["memcpy"].items():
        lines.append(f"| {what} | - | {median(times):.3f} | {nbytes / median(times) / 1e9:.2f} | "
                     f"{copy / median(times):.1%} |")
    for name in ("before", "after"):
        for via, times in results.get(name, {}).get("transfer", {}).items():
            lines.append(f"| {name} | {via} | {median(times):.3f} | {nbytes / median(times) / 1e9:.2f} | "
                         f"{copy / median(times):.1%} |")
    lines += ["", "| version | local prefill TTFT s (median, range) | remote prefill TTFT s | remote/local | "
              "remote/local by round (median, range) | local via a router of its own s | remote / local via router "
              "| P/D decisions | MB sent, by way |", "|---|---|---|---|---|---|---|---|---|"]
    for name in ("before", "after"):
        ratios = []
        for layout, t in results.get(name, {}).get("ttft", {}).items():
            lo, re_ = t["local prefill"], t["remote prefill"]
            via = t.get("local prefill via router") or [float("nan")]
            # each round sends the paths one after the other: its ratio leaves out the machine's slower drifts
            rounds = [b / a for a, b in zip(lo, re_, strict=True)]
            ratios.append((median(re_) / median(lo), median(rounds)))
            lines.append(f"| {name}, {layout} | {median(lo):.2f} ({min(lo):.2f}-{max(lo):.2f}) | {median(re_):.2f} "
                         f"({min(re_):.2f}-{max(re_):.2f}) | {median(re_) / median(lo):.3f} | {median(rounds):.3f} "
                         f"({min(rounds):.3f}-{max(rounds):.3f}) | {median(via):.2f} "
                         f"({min(via):.2f}-{max(via):.2f}) | {median(re_) / median(via):.3f} | "
                         f"{json.dumps(results[name]['pd_decisions'][layout])} | "
                         f"{json.dumps(results[name]['sent_via'][layout])} |")
        if len(ratios) > 1:  # the geometric mean over the layouts: each core's speed counts once on either side
            lines.append(f"| {name}, both layouts (geometric mean) | | | {geomean([r for r, _ in ratios]):.3f} | "
                         f"{geomean([r for _, r in ratios]):.3f} | | | | |")
    for name in ("before", "after"):
        for layout, c in results.get(name, {}).get("control", {}).items():
            d, p = c["decode worker"], c["prefill worker"]
            pairs = [b / a for a, b in zip(d, p, strict=True)]
            lines += ["", f"control ({name}, {layout}): local prefill TTFT on the prefill worker / on the decode "
                          f"worker, no P/D: {median(p) / median(d):.3f} (pairwise {median(pairs):.3f}, "
                          f"{min(pairs):.3f}-{max(pairs):.3f}, {len(pairs)} pairs)"]
    lines += ["", "| frame dtype (fp32 pool) | outputs identical to local prefill | median first divergence (token) |",
              "|---|---|---|"]
    for dtype, r in q.items():
        lines.append(f"| {dtype} | {r['identical']}/{r['prompts']} | {r['first_divergence_median']} |")
    return lines


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="a checkout of main: measure its worker and sender too")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens (full 16-token blocks travel)")
    ap.add_argument("--repeats", type=int, default=5, help="transfers per way")
    ap.add_argument("--ttft-repeats", type=int, default=4, help="prompts per path")
    ap.add_argument("--control-pairs", type=int, default=0,
                    help="also prefill fresh prompts locally on both workers, alternately (the noise between them)")
    ap.add_argument("--quality-prompts", type=int, default=6, help="prompts per frame dtype (0: skip)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="results/kv_transfer")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.ttft_repeats, args.quality_prompts = 2, 2, 2
    out_dir = Path(args.out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()[0]]
    header, _ = fresh_frame(0, args.tokens // 16)
    nbytes = header.frame_bytes()
    results: dict = {"memcpy": memcpy(nbytes, args.repeats)}
    if args.before:
        results["before"] = run_version("before", args.before.resolve(), args, out_dir / "logs")
    results["after"] = run_version("after", HERE, args, out_dir / "logs")
    q = quality(args.quality_prompts, 24) if args.quality_prompts else {}
    load.append(os.getloadavg()[0])
    lines = report(results, nbytes, q)
    print("\n".join(lines))
    print(f"frame: {nbytes / 1e6:.1f} MB; load average {load[0]:.2f} before, {load[1]:.2f} after")
    (out_dir / "kv_transfer.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "cpu": cpu_model(), "cores": os.cpu_count(), "frame_bytes": nbytes,
         "results": results, "quality": q, "load": load, "table": lines,
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
