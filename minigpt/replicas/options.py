"""The --replicas flags of `minigpt batch` and `minigpt serve`; importing this module never imports Ray."""

from __future__ import annotations

import argparse
import importlib.util

MISSING_RAY = 'replicas run on Ray: pip install "minigpt[ray]"'


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas (the ray extra)")
    group.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="engine replicas, each a whole engine on a Ray cluster (%(default)s: this process, no Ray)")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="the Ray cluster to run on (host:port, or 'auto'; default: a local one on 127.0.0.1, "
                            "started and stopped with the command)")
    group.add_argument("--cpus-per-replica", type=float, default=1.0, metavar="N",
                       help="CPUs Ray reserves for each replica (%(default)s)")
    group.add_argument("--gpus-per-replica", type=float, default=None, metavar="N",
                       help="GPUs Ray reserves for each replica (default: 1 with --device cuda, else 0)")


def add_autoscaling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("autoscaling (with the ray extra)")
    group.add_argument("--min-replicas", type=int, default=None, metavar="N",
                       help="autoscale the replicas on queue depth, down to N (default: 1 with --max-replicas)")
    group.add_argument("--max-replicas", type=int, default=None, metavar="N",
                       help="... up to N, each replica's target its --max-num-seqs requests in flight")


def uses_ray(args: argparse.Namespace) -> bool:
    autoscaled = getattr(args, "min_replicas", None) is not None or getattr(args, "max_replicas", None) is not None
    return args.replicas > 1 or args.ray_address is not None or autoscaled


def replica_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the replica flags, in a flag's words (None: nothing)."""
    if args.replicas < 1:
        return f"--replicas must be a positive number, got {args.replicas}"
    if not args.cpus_per_replica >= 0:
        return f"--cpus-per-replica must be a number >= 0, got {args.cpus_per_replica}"
    if args.gpus_per_replica is not None and not args.gpus_per_replica >= 0:
        return f"--gpus-per-replica must be a number >= 0, got {args.gpus_per_replica}"
    low, high = getattr(args, "min_replicas", None), getattr(args, "max_replicas", None)
    if low is not None and low < 0:
        return f"--min-replicas must be a number >= 0, got {low}"
    if high is not None and high < max(low or 0, 1):
        return f"--max-replicas must be at least 1 and --min-replicas, got {high}"
    return None


def ray_missing(args: argparse.Namespace) -> bool:
    """The flags ask for Ray, which is not installed."""
    return uses_ray(args) and importlib.util.find_spec("ray") is None


def replica_resources(args: argparse.Namespace) -> dict[str, float]:
    """What Ray reserves for one replica."""
    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else float(args.device == "cuda")
    return {"num_cpus": args.cpus_per_replica, "num_gpus": gpus}
