"""The real server (`ultrafast serve` as a child process) on a free loopback port."""

import pytest

from tests.e2e.playground_browser import browser, phone  # noqa: F401 (fixtures)
from ultrafast_harness.bench.server_process import ServerProcess


@pytest.fixture(scope="session")
def server():
    # a loose priority TTFT target: these tests check behaviour, not admission (tested apart)
    srv = ServerProcess("--priority-ttft-ms", "10000")
    yield srv
    srv.stop()
