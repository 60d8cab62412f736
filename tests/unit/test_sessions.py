"""The session store, both backends against the same tests: SQLite (a temp file) and a real
redis-server that this module starts on a free loopback port (and restarts mid-conversation)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import pytest

from ultrafast.server.sessions.backends import open_store
from ultrafast.server.sessions.flow import SessionFlow
from ultrafast.server.sessions.store import (
    CHAT_COMPLETION,
    RESPONSE,
    SeqConflict,
    StoredObject,
    StoreUnavailable,
    TooManySessions,
    Turn,
)


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/sessions.db"
    server = request.getfixturevalue("redis_server")
    if server.proc is None:
        server.start()
    return server.url


def run(coro):
    return asyncio.run(coro)


async def _with_store(url, fn, **kwargs):
    store = open_store(url, **kwargs)
    try:
        return await fn(store)
    finally:
        await store.close()


def _tenant() -> str:
    return "t" + uuid.uuid4().hex[:8]  # each test its own tenant: isolation is under test too


def test_append_assigns_seq_and_a_retried_turn_id_is_stored_once(store_url):
    tenant = _tenant()

    async def body(store):
        await store.create(tenant, "s1")
        a = await store.append(tenant, "s1", Turn("u0", "user", "hello"))
        b = await store.append(tenant, "s1", Turn("a0", "assistant", 'a "quoted" "seq":-1 text'))
        again = await store.append(tenant, "s1", Turn("u0", "user", "hello (retried)"))
        turns = await store.turns(tenant, "s1")
        return a, b, again, turns

    a, b, again, turns = run(_with_store(store_url, body))
    assert (a.seq, b.seq) == (0, 1)
    assert again.seq == 0 and again.content == "hello"  # the first write wins, no duplicate
    assert [(t.seq, t.turn_id, t.content) for t in turns] == [
        (0, "u0", "hello"),
        (1, "a0", 'a "quoted" "seq":-1 text'),
    ]


def test_tenants_never_see_each_others_sessions(store_url):
    a, b = _tenant(), _tenant()

    async def body(store):
        await store.create(a, "shared-name")
        await store.append(a, "shared-name", Turn("u0", "user", "secret"))
        seen = (await store.get(b, "shared-name"), await store.turns(b, "shared-name"))
        with pytest.raises(KeyError):
            await store.append(b, "shared-name", Turn("x", "user", "intrude"))
        deleted = await store.delete(b, "shared-name")
        return seen, deleted, await store.turns(a, "shared-name")

    (info, turns), deleted, kept = run(_with_store(store_url, body))
    assert info is None and turns == [] and deleted is False
    assert [t.content for t in kept] == ["secret"]


def test_expect_seq_detects_a_branch(store_url):
    tenant = _tenant()

    async def body(store):
        await store.create(tenant, "s")
        await store.append(tenant, "s", Turn("u0", "user", "x"), expect_seq=0)
        with pytest.raises(SeqConflict):
            await store.append(tenant, "s", Turn("u1", "user", "y"), expect_seq=0)
        return await store.turns(tenant, "s", upto_seq=0)

    assert [t.turn_id for t in run(_with_store(store_url, body))] == ["u0"]


def test_per_tenant_bound_and_ttl(store_url):
    tenant = _tenant()

    async def body(store):
        await store.create(tenant, "s1")
        await store.create(tenant, "s2")
        await store.create(tenant, "s1")  # existing: idempotent, not a third session
        with pytest.raises(TooManySessions):
            await store.create(tenant, "s3")
        await store.create(_tenant(), "s3")  # another tenant has its own bound
        await asyncio.sleep(1.3)  # past the TTL: both expire, making room
        gone = await store.get(tenant, "s1")
        await store.create(tenant, "s3")
        return gone

    assert run(_with_store(store_url, body, ttl_s=1.0, max_sessions_per_tenant=2)) is None


def test_responses_records_round_trip_and_delete(store_url):
    tenant = _tenant()
    stored = StoredObject({"id": "resp_1"}, created_s=5.0, session_id="conv_x", seq=3)

    async def body(store):
        await store.put_object(tenant, RESPONSE, "resp_1", stored)
        got = await store.get_object(tenant, RESPONSE, "resp_1")
        other = await store.get_object(_tenant(), RESPONSE, "resp_1")
        other_kind = await store.get_object(tenant, CHAT_COMPLETION, "resp_1")
        deleted = await store.delete_object(tenant, RESPONSE, "resp_1")
        return got, other, other_kind, deleted, await store.get_object(tenant, RESPONSE, "resp_1")

    # the bookkeeping (session, seq) comes back beside the public body, never inside it
    assert run(_with_store(store_url, body)) == (stored, None, None, True, None)


def test_stored_objects_list_oldest_first_per_tenant_and_kind(store_url):
    tenant = _tenant()

    async def body(store):
        for i, created in enumerate((30.0, 10.0, 20.0)):
            await store.put_object(
                tenant,
                CHAT_COMPLETION,
                f"c{i}",
                StoredObject({"id": f"c{i}"}, created_s=created, metadata={"k": str(i)}),
            )
        await store.put_object(_tenant(), CHAT_COMPLETION, "c9", StoredObject({"id": "c9"}))
        await store.put_object(tenant, RESPONSE, "r0", StoredObject({"id": "r0"}))
        listed = [o.body["id"] for o in await store.list_objects(tenant, CHAT_COMPLETION)]
        await store.delete_object(tenant, CHAT_COMPLETION, "c2")
        after = [o.metadata for o in await store.list_objects(tenant, CHAT_COMPLETION)]
        return listed, after

    assert run(_with_store(store_url, body)) == (["c1", "c2", "c0"], [{"k": "1"}, {"k": "0"}])


def test_session_metadata_is_replaced_and_a_missing_session_says_so(store_url):
    tenant = _tenant()

    async def body(store):
        await store.create(tenant, "s", {"a": "1"})
        updated = await store.set_metadata(tenant, "s", {"b": "2"})
        got = await store.get(tenant, "s")
        missing = await store.set_metadata(tenant, "nope", {"b": "2"})
        return updated.metadata, got.metadata, missing

    assert run(_with_store(store_url, body)) == ({"b": "2"}, {"b": "2"}, None)


def test_redis_outage_raises_unavailable_and_restart_keeps_each_turn_once(redis_server):
    tenant = _tenant()

    async def body(store):
        flow = SessionFlow(store, commit_grace_s=20.0)
        await store.create(tenant, "s")
        await store.append(tenant, "s", Turn("u0", "user", "before"))
        redis_server.stop()
        with pytest.raises(StoreUnavailable):
            await store.turns(tenant, "s")
        # a commit during the outage retries with the same turn id until Redis is back
        loop = asyncio.get_running_loop()
        restart = loop.run_in_executor(None, redis_server.start)
        stored = await flow.commit(tenant, "s", Turn("a0", "assistant", "during"))
        await restart
        again = await flow.commit(tenant, "s", Turn("a0", "assistant", "during"))
        await store.append(tenant, "s", Turn("u1", "user", "after"))
        return stored, again, await store.turns(tenant, "s")

    stored, again, turns = run(_with_store(redis_server.url, body))
    assert stored is not None and again.seq == stored.seq == 1
    assert [t.turn_id for t in turns] == ["u0", "a0", "u1"]
    assert [t.seq for t in turns] == [0, 1, 2]


def test_sqlite_history_survives_a_new_process(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    code = (
        "import asyncio, sys\nfrom ultrafast.server.sessions.backends import open_store\n"
        "from ultrafast.server.sessions.store import Turn\n"
        "async def main():\n    s = open_store(sys.argv[1])\n    await s.create('t', 'c')\n"
        "    await s.append('t', 'c', Turn('u0', 'user', 'kept'))\n    await s.close()\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", code, url], check=True)

    async def body(store):
        return await store.turns("t", "c")

    assert [t.content for t in run(_with_store(url, body))] == ["kept"]


def test_unwritable_sqlite_is_unavailable_not_a_crash(tmp_path):
    (tmp_path / "file").write_text("x")

    async def body(store):
        with pytest.raises(StoreUnavailable):
            await store.create("t", "c")

    run(_with_store(f"sqlite:///{tmp_path}/file/sub/s.db", body))


def test_bad_store_urls_are_refused():
    with pytest.raises(ValueError):
        open_store("postgres://x")


def test_the_embedded_store_is_created_private(tmp_path):
    """sessions.db (and its WAL files) 0600 in a 0700 directory: conversations are private."""
    import stat

    path = tmp_path / "state" / "sessions.db"

    async def body(store):
        await store.create("t", "s1")
        await store.append("t", "s1", Turn("u0", "user", "hello"))

    run(_with_store(f"sqlite:///{path}", body))
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    files = [p for p in path.parent.iterdir() if p.name.startswith("sessions.db")]
    assert path in files
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), files
