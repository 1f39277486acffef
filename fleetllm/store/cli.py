"""``fleetllm models``: pull a model into the node's cache (with its cold-start phases), list, remove, verify.

    fleetllm models pull hf://HuggingFaceTB/SmolLM2-135M-Instruct@main [--load]
    fleetllm models ls
    fleetllm models rm hf://HuggingFaceTB/SmolLM2-135M-Instruct[@<commit>]
    fleetllm models verify [SOURCE] [--repair]

``verify`` hashes every cached file; one whose bytes no longer match its manifest (bit rot, a stray write) is
quarantined: moved out of the model's files and dropped from the manifest, so the next start fetches it again
from the source, or, offline, refuses to start and says why. ``--repair`` fetches it again now.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from fleetllm.cli_options import add_options, from_args
from fleetllm.errors import UsageError
from fleetllm.store.config import StoreConfig
from fleetllm.store.phases import format_phases

if TYPE_CHECKING:
    from fleetllm.store.cache import Manifest, Revision


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


def _matching(args: argparse.Namespace) -> list[tuple[Revision, Manifest]]:
    """The cached revisions SOURCE names (every one without SOURCE); none for a SOURCE is a UsageError."""
    from fleetllm.store.uri import ModelURI

    revs = _store(args).cache.revisions()
    if not args.source:
        return revs
    uri = ModelURI.parse(args.source)
    found = [(r, m) for r, m in revs if ModelURI.parse(m.uri).key == uri.key
             and (uri.revision is None or uri.revision == m.commit)]
    if not found:
        raise UsageError(f"nothing cached for {args.source} (`fleetllm models ls` lists what is)")
    return found


def cmd_rm(args: argparse.Namespace) -> int:
    for rev, m in _matching(args):
        if not rev.unused():
            print(f"{m.uri}: in use by a running worker, kept", file=sys.stderr)
            continue
        rev.remove()
        print(f"removed {m.uri} ({m.size() / 1e6:.1f} MB)")
    return 0


def damaged_files(rev: Revision, m: Manifest) -> dict[str, tuple[dict, str]]:
    """Every file of ``m`` whose bytes no longer hash to its entry, or gone: ``name -> (entry, why)``."""
    from fleetllm.store.checksum import Checksum, check

    damaged = {}
    for name, entry in sorted(m.files.items()):
        try:
            check(rev.files / name, Checksum("sha256", entry["sha256"]))
        except (OSError, ValueError) as e:
            damaged[name] = (entry, str(e))
    return damaged


def cmd_verify(args: argparse.Namespace) -> int:
    store, left = _store(args), 0
    for rev, m in _matching(args):
        damaged = damaged_files(rev, m)
        for name in rev.quarantine(damaged):
            print(f"{m.uri}: {name}: {damaged[name][1]}: quarantined (the next start fetches it again)")
        print(f"{m.uri}: {len(m.files)} files checked")
        aside = sorted((rev.manifest() or m).quarantined)
        if aside and args.repair:
            for name in store.repair(m.uri, m.commit):
                print(f"{m.uri}: {name}: fetched again from the source")
        elif aside:
            print(f"{m.uri}: {', '.join(aside)} set aside: `fleetllm models verify --repair` fetches it now")
            left += len(aside)
    print(f"{left} file(s) quarantined, not yet fetched again" if left else "all files match their manifests")
    return 1 if left else 0


def cmd_models(args: argparse.Namespace) -> int:
    commands = {"pull": cmd_pull, "ls": cmd_ls, "rm": cmd_rm, "verify": cmd_verify}
    return commands[args.models_command](args) or 0


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
        if name == "verify":
            c.add_argument("--repair", action="store_true",
                           help="fetch again now every file verify quarantined (default: the next start does)")
    for c in ms.choices.values():
        add_options(c, StoreConfig, title="model store")
    p.set_defaults(func=cmd_models)
