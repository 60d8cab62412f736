"""The real server (`ultrafast serve` as a child process) on a free loopback port."""

import pytest

from ultrafast.bench.server_process import ServerProcess


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess()
    yield srv
    srv.stop()
