"""``fleetllm models``: pull a model into the node's cache (with its cold-start phases), list, remove, verify.

    fleetllm models pull hf://HuggingFaceTB/SmolLM2-135M-Instruct@main [--load]
    fleetllm models ls
    fleetllm models rm hf://HuggingFaceTB/SmolLM2-135M-Instruct[@<commit>]
    fleetllm models verify [SOURCE]
"""

from __future__ import annotations

import argparse
import sys
import time

from fleetllm.cli_options import add_options, from_args
from fleetllm.store.config import StoreConfig
from fleetllm.store.errors import StoreError
from fleetllm.store.phases import format_phases


def _store(args: argparse.Namespace):  # -> ModelStore
    from fleetllm.store.store import ModelStore

    return ModelStore(from_args(StoreConfig, args))


def cmd_pull(args: argparse.Namespace) -> None:
    fetched = _store(args).fetch(args.source)
    fetched.release()  # pulled for workers to come: this process does not serve it
    phases = dict(fetched.phases)
    if args.load:  # the rest of a worker's cold start: weights into memory, the first forward passes
        from fleetllm.engine.config import EngineConfig
        from fleetllm.engine.engine import LLMEngine

        engine = LLMEngine(EngineConfig(model=str(fetched.uri), num_blocks=64, store=from_args(StoreConfig, args)))
        phases["load"] = engine.loaded.phases["load"]
        phases["warm_up"] = engine.warm_up()
    size = sum((fetched.path / n if fetched.path.is_dir() else fetched.path).stat().st_size
               for n in (fetched.downloaded or [""]) if fetched.downloaded)
    print(f"{fetched.uri}  {fetched.path}" + ("  (offline: served from the cache)" if fetched.offline else ""))
    print(f"  {format_phases(phases)}")
    rate = f" ({size / 1e6 / phases['download']:.1f} MB/s)" if phases["download"] > 0 else ""
    print(f"  downloaded {len(fetched.downloaded)} files, {size / 1e6:.1f} MB{rate}")


def cmd_ls(args: argparse.Namespace) -> None:
    for rev, m in _store(args).cache.revisions():
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(rev.last_used())) if rev.last_used() else "never"
        state = "in use" if not rev.unused() else "idle"
        print(f"{m.uri}  {m.size() / 1e6:.1f} MB  {len(m.files)} files  last used {used}  {state}  {rev.files}")


def _matching(args: argparse.Namespace):  # -> list[(Revision, Manifest)]
    from fleetllm.store.uri import ModelURI

    revs = _store(args).cache.revisions()
    if not args.source:
        return revs
    uri = ModelURI.parse(args.source)
    return [(r, m) for r, m in revs if ModelURI.parse(m.uri).key == uri.key
            and (uri.revision is None or uri.revision == m.commit)]


def cmd_rm(args: argparse.Namespace) -> int:
    found = _matching(args)
    if not found:
        print(f"nothing cached for {args.source}", file=sys.stderr)
        return 1
    for rev, m in found:
        if not rev.unused():
            print(f"{m.uri}: in use by a running worker, kept", file=sys.stderr)
            continue
        rev.remove()
        print(f"removed {m.uri} ({m.size() / 1e6:.1f} MB)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from fleetllm.store.checksum import Checksum, check

    bad = 0
    for rev, m in _matching(args):
        for name, f in sorted(m.files.items()):
            try:
                check(rev.files / name, Checksum("sha256", f["sha256"]))
            except (OSError, ValueError) as e:
                bad += 1
                print(f"{m.uri}: {name}: {e}")
        print(f"{m.uri}: {len(m.files)} files checked")
    print(f"{bad} corrupt or missing file(s)" if bad else "all files match their manifests")
    return 1 if bad else 0


def cmd_models(args: argparse.Namespace) -> int:
    commands = {"pull": cmd_pull, "ls": cmd_ls, "rm": cmd_rm, "verify": cmd_verify}
    try:
        return commands[args.models_command](args) or 0
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="the node's model cache: pull hf:// and s3:// models, ls, rm, verify")
    ms = p.add_subparsers(dest="models_command", required=True)
    pull = ms.add_parser("pull", help="fetch a model into the cache and print its cold-start phases")
    pull.add_argument("source", help="hf://org/name[/file.gguf][@revision] or s3://bucket/prefix")
    pull.add_argument("--load", action="store_true", help="also load it and warm up an engine (load, warm_up)")
    ms.add_parser("ls", help="cached revisions: size, files, last use")
    for name, text in (("rm", "remove cached revisions (every revision unless SOURCE names one)"),
                       ("verify", "check every cached file against its manifest's SHA-256")):
        c = ms.add_parser(name, help=text)
        c.add_argument("source", nargs="?" if name == "verify" else None, default=None)
    for c in ms.choices.values():
        add_options(c, StoreConfig, title="model store")
    p.set_defaults(func=cmd_models)
