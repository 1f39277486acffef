"""``fleetllm deploy kubernetes --config fleet.yaml``: write a fleet's manifests to a directory."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from fleetllm.cli_options import add_options, from_args, opt
from fleetllm.deploy.kubernetes.options import KubernetesOptions
from fleetllm.errors import UsageError


@dataclass
class DeployOptions:
    """Which fleet, and where its manifests go."""

    config: str = opt(doc="fleet YAML (the `models:` schema of docs/fleet.md)")
    out: str = opt("k8s", "directory the manifests are written to")


def cmd_kubernetes(args: argparse.Namespace) -> int:
    from fleetllm.deploy.kubernetes.render import write
    from fleetllm.fleet.config import FleetConfig

    try:
        opts = from_args(KubernetesOptions, args)
        paths = write(FleetConfig.from_yaml(args.config), opts, args.out)
    except UsageError:
        raise
    except (ValueError, OSError) as e:  # a config the cluster cannot take, an --out not writable: one line
        raise UsageError(str(e)) from None
    for p in paths:
        print(p)
    print(f"create the Secrets of {paths[-1]} first, then: kubectl apply -f {args.out}")
    return 0


def add_deploy_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("deploy", help="manifests that run a fleet elsewhere: kubernetes")
    ds = d.add_subparsers(dest="deploy_command", required=True)
    k = ds.add_parser("kubernetes", help="Kubernetes manifests for a fleet (KubeRay RayService with --ray)")
    add_options(k, DeployOptions)
    add_options(k, KubernetesOptions, title="cluster")
    k.set_defaults(func=cmd_kubernetes)
