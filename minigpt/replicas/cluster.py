"""The Ray cluster replicas run on: --ray-address's, or a local one on 127.0.0.1 started for the command."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

# Ray's single-machine mode (every address 127.0.0.1) and no usage statistics; read when ray is imported
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
CONNECT_SECONDS = 10  # for a cluster's head to accept a connection (ray.init itself retries for minutes)


def bind_loopback() -> None:
    """In each worker of a local cluster: Serve replicas' own gRPC server listens on 127.0.0.1, not every interface."""
    from ray.serve._private import replica

    add_port = replica.add_port_to_grpc_server
    replica.add_port_to_grpc_server = lambda server, address: add_port(server, address.replace("[::]", "127.0.0.1"))


LOCAL = {"include_dashboard": False, "_node_ip_address": "127.0.0.1",
         "runtime_env": {"worker_process_setup_hook": f"{__name__}.bind_loopback"}}


def prepare_local_cluster() -> None:
    """Before ray is imported: a local cluster started by this process listens on 127.0.0.1 only."""
    for name, value in LOOPBACK_ONLY.items():
        os.environ.setdefault(name, value)


def check_reachable(address: str) -> None:
    """A `host:port` address whose head accepts no connection is refused at once; `auto` and `ray://` pass."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as err:
        raise RuntimeError(f"no Ray cluster answers at --ray-address {address}: {err.strerror or err} (start its "
                           "head with `ray start --head`, or leave --ray-address out for a local cluster)") from None


@contextmanager
def ray_cluster(address: str | None, quiet: bool) -> Iterator[ModuleType]:
    """`ray` connected for the block (address None: a new local cluster); a process already connected keeps it."""
    if address is None:
        prepare_local_cluster()
    else:
        check_reachable(address)
    import ray
    from ray._private import ray_constants

    asked = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"
    if address is None and asked and ray_constants.ENABLE_RAY_CLUSTER and not ray.is_initialized():
        raise RuntimeError("ray was imported before minigpt asked it for a loopback-only cluster: call "
                           "minigpt.replicas.cluster.prepare_local_cluster() first, or give --ray-address")
    if ray.is_initialized():
        yield ray
        return
    level = logging.WARNING if quiet else logging.INFO
    where = LOCAL if address is None else {"address": address}
    ray.init(log_to_driver=not quiet, logging_level=level, **where)
    try:
        yield ray
    finally:
        ray.shutdown()
