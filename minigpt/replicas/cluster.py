"""The Ray cluster replicas run on: --ray-address's, or a local one on 127.0.0.1 started for the command."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

# Ray's single-machine mode (every address 127.0.0.1) and no usage statistics; read when ray is imported
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@contextmanager
def ray_cluster(address: str | None, quiet: bool) -> Iterator[ModuleType]:
    """`ray` connected for the block (address None: a new local cluster); a process already connected keeps it."""
    if address is None:
        for name, value in LOOPBACK_ONLY.items():
            os.environ.setdefault(name, value)  # the local cluster's processes inherit it
    import ray

    if ray.is_initialized():
        yield ray
        return
    level = logging.WARNING if quiet else logging.INFO
    where = {"include_dashboard": False, "_node_ip_address": "127.0.0.1"} if address is None else {"address": address}
    ray.init(log_to_driver=not quiet, logging_level=level, **where)
    try:
        yield ray
    finally:
        ray.shutdown()
