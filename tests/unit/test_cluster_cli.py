"""`ultrafast cluster`'s flags build the same configs `serve` does (no Ray needed to parse)."""

import argparse

from ultrafast.cli_cluster import add_cluster_parser
from ultrafast.cli_serve import kv_cache_options, server_config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_parser(parser.add_subparsers())
    return parser.parse_args(["cluster", "models/demo-code", *argv])


def test_cluster_flags_make_a_server_config_with_one_model_per_replica():
    config = server_config(parse("--replicas", "3"))
    assert config.models == () and config.max_resident_bytes == 0


def test_the_kv_store_reaches_every_replicas_engine_config():
    args = parse("--kv-store", "redis://127.0.0.1:6399/0", "--kv-host-cache-gb", "1")
    options = kv_cache_options(args)
    assert options["kv_store"] == "redis://127.0.0.1:6399/0"
    assert options["kv_host_cache_gb"] == 1.0
