"""Redis with credentials and TLS (issue 29 item 8): the session store, the KV tier and a
cluster's shared limits accept `redis://user:password@host/db` and `rediss://` (with
--redis-ca-file), against a real redis-server started with requirepass, an ACL user and TLS;
refused credentials are a clear start-up error, never a silent fallback."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import pytest

from ultrafast.cluster.shared_limits import SharedLimits
from ultrafast.kvcache.redis_tier import RedisTier
from ultrafast.local_tools import find_tool
from ultrafast.redis_conn import redacted
from ultrafast.server.sessions.backends import open_store
from ultrafast.server.sessions.store import Turn
from ultrafast_harness.bench.redis_server import RedisServer
from ultrafast_harness.bench.server_process import free_port

PASSWORD = "s3cret-pw"


def _redis(*extra: str) -> RedisServer:
    if find_tool("redis-server") is None:
        pytest.skip("redis-server is not in .tools/bin nor on PATH (`make tools` unpacks it)")
    return RedisServer(extra_args=extra)


@pytest.fixture(scope="module")
def password_redis():
    server = _redis(
        "--requirepass", PASSWORD, "--user", "alice", "on", ">alice-pw", "~*", "&*", "+@all"
    )
    server.extra_url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    yield server
    server.close()


def _use_every_client(url: str, ca_file: str | None = None) -> None:
    """A session turn, a KV blob and a shared-limit take through `url`."""

    async def session() -> None:
        store = open_store(url, ca_file=ca_file)
        await store.create("t", "s1")
        await store.append("t", "s1", Turn("turn-1", "user", "hello"))
        turns = await store.turns("t", "s1")
        assert [t.content for t in turns] == ["hello"]
        await store.close()

    asyncio.run(session())
    tier = RedisTier(url, ca_file=ca_file)
    assert tier.put("ab" * 16, b"blob") and tier.get("ab" * 16) == b"blob"
    assert not tier.stats.degraded
    tier.close()
    limits = SharedLimits(url, fail="closed", prefix="t:", ca_file=ca_file)
    assert limits.call("k", 1.0, 5.0, 1.0, "take") == 0.0 and limits.errors == 0


def test_a_password_in_the_url_is_used(password_redis):
    _use_every_client(password_redis.extra_url)


def test_an_acl_user_in_the_url_is_used(password_redis):
    _use_every_client(f"redis://alice:alice-pw@127.0.0.1:{password_redis.port}/0")


@pytest.mark.parametrize(
    "userinfo", [":wrong", "alice:wrong", "nobody:x", ""], ids=["pw", "acl", "user", "none"]
)
def test_refused_credentials_are_a_clear_start_up_error(password_redis, userinfo):
    at = f"{userinfo}@" if userinfo else ""
    url = f"redis://{at}127.0.0.1:{password_redis.port}/0"
    for make in (
        lambda: open_store(url),
        lambda: RedisTier(url),
        lambda: SharedLimits(url),
    ):
        with pytest.raises(ValueError, match="refused the credentials") as info:
            make()
        assert "wrong" not in str(info.value)  # the password never reaches a message


@pytest.mark.parametrize("flag", ["--session-store", "--kv-store"])
def test_serve_with_a_wrong_password_exits_with_the_reason(password_redis, flag):
    url = f"redis://:wrong@127.0.0.1:{password_redis.port}/0"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ultrafast.cli",
            "serve",
            "--executor",
            "fake",
            "--port",
            str(free_port()),
            flag,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "refused the credentials" in out.stdout + out.stderr
    assert "Traceback" not in out.stderr


def test_redacted_hides_only_the_password():
    assert redacted("redis://alice:pw@h:1/0") == "redis://alice:***@h:1/0"
    assert redacted("rediss://:pw@h/2") == "rediss://:***@h/2"
    assert redacted("redis://h:1/0") == "redis://h:1/0"


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: the test makes its certificates with it")
    d = tmp_path_factory.mktemp("tls")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=ultrafast-test-ca",
        cwd=d,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        "/CN=127.0.0.1",
        cwd=d,
    )
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
        cwd=d,
    )
    tls_port = free_port()
    try:
        server = _redis(
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(d / "srv.crt"),
            "--tls-key-file",
            str(d / "srv.key"),
            "--tls-ca-cert-file",
            str(d / "ca.crt"),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            PASSWORD,
        )
    except RuntimeError as exc:  # a redis-server built without TLS exits at once
        version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
        pytest.skip(f"this redis-server does not start with TLS ({exc}; {version.stdout})")
    server.tls_url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_port}/0"
    server.ca_file = str(d / "ca.crt")
    yield server
    server.close()


def test_tls_with_the_ca_file(tls_redis):
    _use_every_client(tls_redis.tls_url, tls_redis.ca_file)


def test_tls_without_the_ca_file_is_a_clear_start_up_error(tls_redis):
    with pytest.raises(ValueError, match="TLS connection .* failed"):
        RedisTier(tls_redis.tls_url)
