"""Fixtures shared by the unit and end-to-end tests."""

import pytest

from ultrafast_harness.bench.redis_server import RedisServer, RedisServerMissing


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server on a free loopback port, for this test module only."""
    try:
        server = RedisServer()
    except RedisServerMissing as exc:  # CI runs `make test`, whose setup installs it
        pytest.fail(str(exc))
    yield server
    server.close()


@pytest.fixture(scope="session", autouse=True)
def private_data_dir(tmp_path_factory):
    """Servers the tests start keep their default session store (sessions.db under
    $XDG_DATA_HOME/ultrafast) in a temporary directory, not in the user's home."""
    import os

    saved = os.environ.get("XDG_DATA_HOME")
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("xdg-data"))
    yield
    if saved is None:
        os.environ.pop("XDG_DATA_HOME", None)
    else:
        os.environ["XDG_DATA_HOME"] = saved


@pytest.fixture(scope="session", autouse=True)
def demo_model_by_default():
    """Commands the tests run without a model serve the small demo model (fast, and what they
    assert on), not SmolLM2, the default for users; tests of that default unset this."""
    import os

    from ultrafast.config import DEMO_MODEL_DIR

    saved = os.environ.get("ULTRAFAST_MODEL")
    os.environ["ULTRAFAST_MODEL"] = str(DEMO_MODEL_DIR)
    yield
    if saved is None:
        os.environ.pop("ULTRAFAST_MODEL", None)
    else:
        os.environ["ULTRAFAST_MODEL"] = saved
