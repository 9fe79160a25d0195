"""A long-lived segment holder: a process that only contributes memory to a Mooncake pool.

Mooncake keeps every object in a segment owned by a client process; when that process exits, what its
segment held is gone. Engines restart (new weights, crashes, scaling), so a pool that must outlive them
lives in holders instead, and engine workers run with ``segment_size: 0`` (pure clients that hold no
data)::

    python -m kvcore_mooncake.holder --master 127.0.0.1:50051 --segment-size 4GiB

It prints one ``ready`` line once its segment is mounted, then waits for SIGTERM or SIGINT and unmounts.
Exit codes: 0 after a signal, 2 when the master cannot be reached or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from kvcore.config import load_config
from kvcore.errors import BackendUnavailable, ConfigError
from kvcore_mooncake.client import MooncakeClient
from kvcore_mooncake.config import MooncakeStoreConfig

__all__ = ["main", "parse_config"]


def _parser() -> argparse.ArgumentParser:
    defaults = MooncakeStoreConfig()
    parser = argparse.ArgumentParser(
        prog="python -m kvcore_mooncake.holder", description="Hold a Mooncake segment until SIGTERM."
    )
    parser.add_argument("--master", default=defaults.master, help="host:port of mooncake_master")
    parser.add_argument("--segment-size", required=True, help="bytes to contribute, e.g. 4GiB")
    parser.add_argument("--local-hostname", default=defaults.local_hostname, help="address peers reach")
    parser.add_argument("--metadata", default=defaults.metadata, help="metadata server (P2PHANDSHAKE)")
    parser.add_argument("--protocol", default=defaults.protocol, help="tcp or rdma")
    parser.add_argument("--devices", default=defaults.devices, help="RDMA device names, comma-separated")
    parser.add_argument("--setup-timeout", type=float, default=defaults.setup_timeout_s, help="seconds")
    return parser


def parse_config(argv: list[str] | None = None) -> MooncakeStoreConfig:
    """The holder's arguments, validated by kvcore's config converter (``ConfigError`` names a field)."""
    args = _parser().parse_args(argv)
    backend = {
        "kind": MooncakeStoreConfig.KIND,
        "master": args.master,
        "segment_size": args.segment_size,
        "local_hostname": args.local_hostname,
        "metadata": args.metadata,
        "protocol": args.protocol,
        "devices": args.devices,
        "setup_timeout_s": args.setup_timeout,
    }
    config = load_config({"backend": backend}).backend
    if not isinstance(config, MooncakeStoreConfig) or config.segment_size == 0:
        raise ConfigError("segment_size", args.segment_size, "a positive size: a holder that holds nothing")
    return config


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
        client = MooncakeClient.connect(config)
    except (ConfigError, BackendUnavailable) as exc:
        print(f"kvcore_mooncake.holder: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"ready master={config.master} segment_size={config.segment_size}", flush=True)
    while not stop.wait(1.0):
        pass
    client.close(config.setup_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
