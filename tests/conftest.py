"""Fixtures shared by the unit and end-to-end tests."""

import pytest

from ultrafast.bench.redis_server import RedisServer, RedisServerMissing


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server on a free loopback port, for this test module only."""
    try:
        server = RedisServer()
    except RedisServerMissing as exc:  # CI runs `make test`, whose setup installs it
        pytest.fail(str(exc))
    yield server
    server.close()
