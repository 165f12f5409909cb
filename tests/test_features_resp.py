"""The direct reader's lean Redis connection (scorestack.features.resp) against a real redis-server."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from scorestack.features.resp import RespConnection, lean_params, pack


def _admin(private_redis, **kw) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=private_redis.port, socket_timeout=5, **kw)


async def test_concurrent_pipelined_reads_each_get_their_own_replies(private_redis):
    admin = _admin(private_redis)
    for i in range(200):
        admin.hset(f"k{i}", mapping={"a": f"a{i}", "b": f"b{i}"})
    conn = RespConnection("127.0.0.1", private_redis.port)
    try:
        # 200 reads in flight at once on one connection, of 1-3 commands each.
        async def read(i: int):
            keys = [f"k{(i + j) % 200}" for j in range(i % 3 + 1)]
            replies = await conn.request(b"".join(pack("HMGET", k, "b", "a", "missing") for k in keys), len(keys))
            return keys, replies

        for keys, replies in await asyncio.gather(*(read(i) for i in range(200))):
            assert replies == [[f"b{k[1:]}".encode(), f"a{k[1:]}".encode(), None] for k in keys]
        # An error reply is returned in the list, not raised, and the connection stays usable.
        admin.set("plain", "x")
        replies = await conn.request(pack("HMGET", "plain", "a") + pack("HMGET", "k7", "a"), 2)
        assert isinstance(replies[0], Exception) and "WRONGTYPE" in str(replies[0])
        assert replies[1] == [b"a7"]
    finally:
        await conn.close()
        admin.close()


async def test_a_read_given_up_drops_the_connection_and_the_next_read_reconnects(private_redis):
    admin = _admin(private_redis)
    admin.hset("user", mapping={"a": "1"})
    conn = RespConnection("127.0.0.1", private_redis.port)
    try:
        assert await conn.request(pack("HMGET", "user", "a"), 1) == [[b"1"]]
        first = conn._protocol
        admin.execute_command("CLIENT", "PAUSE", 300, "ALL")
        paused_until = time.monotonic() + 0.3
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await conn.request(pack("HMGET", "user", "a"), 1)
        assert first.lost is not None  # aborted: no later read waits behind the stalled one
        await asyncio.sleep(max(paused_until - time.monotonic(), 0) + 0.05)
        admin.hset("user", mapping={"a": "2"})
        assert await conn.request(pack("HMGET", "user", "a"), 1) == [[b"2"]]
        assert conn._protocol is not first
    finally:
        await conn.close()
        admin.close()


async def test_a_stopped_server_fails_reads_and_a_restarted_one_serves_them(private_redis):
    conn = RespConnection("127.0.0.1", private_redis.port, socket_connect_timeout=0.5)
    try:
        assert await conn.request(pack("PING"), 1) == [b"PONG"]
        private_redis.stop()
        with pytest.raises(ConnectionError):
            await conn.request(pack("PING"), 1)
        with pytest.raises(ConnectionError):  # refused at connect
            await conn.request(pack("PING"), 1)
        private_redis.start()
        assert await conn.request(pack("PING"), 1) == [b"PONG"]
    finally:
        await conn.close()


async def test_auth_username_and_db_are_applied_at_connect(private_redis):
    admin = _admin(private_redis)
    admin.execute_command("ACL", "SETUSER", "reader", "on", ">s3cret", "~*", "+@all")
    admin.execute_command("CONFIG", "SET", "requirepass", "topsecret")
    admin.close()
    admin = _admin(private_redis, password="topsecret", db=3)
    admin.hset("in-db-3", mapping={"a": "3"})
    try:
        for kw in ({"password": "topsecret"}, {"username": "reader", "password": "s3cret"}):
            conn = RespConnection("127.0.0.1", private_redis.port, db=3, **kw)
            try:
                assert await conn.request(pack("HMGET", "in-db-3", "a"), 1) == [[b"3"]]
            finally:
                await conn.close()
        wrong = RespConnection("127.0.0.1", private_redis.port, password="wrong")
        with pytest.raises(ConnectionError, match="connection setup refused"):
            await wrong.request(pack("PING"), 1)
        await wrong.close()
    finally:
        admin.close()


def test_lean_params_name_what_they_do_not_implement():
    assert lean_params({"db": 0, "password": "x", "socket_connect_timeout": 0.5}) is None
    reason = lean_params({"db": 0, "ssl_ca_certs": "/ca.pem", "ssl": True})
    assert reason is not None and "ssl_ca_certs" in reason
