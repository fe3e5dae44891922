"""A stock redis-py client with its default settings against a Redis-protocol port.

Usage: python3 redis_py_client.py HOST:PORT. Exits non-zero (an AssertionError or
redis-py's own exception) on the first reply that is not what Redis would give; prints
"redis-py VERSION ok (RESP N)" otherwise. redis-py 5 and later send CLIENT SETINFO on
connect, and 8 also HELLO 3 (RESP3) by default; Debian 12's 4.3.4 sends neither.
"""

import sys

import redis

host, port = sys.argv[1].rsplit(":", 1)
major = int(redis.__version__.split(".")[0])
r = redis.Redis(host=host, port=int(port))  # default settings, as a new user writes it
# Keys of their own, so that clients run one after the other against one server agree.
P = f"redis-py-{redis.__version__}:"

assert r.ping() is True
protocol = 2
if major >= 8:
    # The handshake the pool's connection made: HELLO 3 must have been answered as
    # Redis answers it, or redis-py raises "Invalid RESP version" on connect.
    conn = r.connection_pool.get_connection()
    try:
        assert conn.handshake_metadata is not None, "no HELLO on connect"
        proto = conn.handshake_metadata.get(b"proto", conn.handshake_metadata.get("proto"))
        assert proto == 3, conn.handshake_metadata
        protocol = 3
    finally:
        r.connection_pool.release(conn)
if major >= 5:
    # On connect redis-py ignores a SETINFO error; asked directly, it must be OK.
    assert r.client_setinfo("lib-name", "redis-py") is True
    assert r.client_setinfo("lib-ver", redis.__version__) is True

assert r.set(P + "greeting", "hello") is True
assert r.get(P + "greeting") == b"hello"
assert r.get(P + "nosuch") is None
assert r.hset(P + "h", mapping={"a": "1", "b": "2"}) == 2
assert r.hgetall(P + "h") == {b"a": b"1", b"b": b"2"}
assert r.hget(P + "h", "b") == b"2"

# A pipeline without a transaction: 100 SETs, then 100 GETs, in one round trip.
p = r.pipeline(transaction=False)
for i in range(100):
    p.set(f"{P}k{i}", i)
for i in range(100):
    p.get(f"{P}k{i}")
out = p.execute()
assert out[:100] == [True] * 100, out[:100]
assert out[100:] == [str(i).encode() for i in range(100)], out[100:]

# A transaction: MULTI … EXEC, as redis-py's default pipeline sends it.
with r.pipeline() as p:
    p.set(P + "n", 1)
    p.incr(P + "n")
    p.incrby(P + "n", 5)
    p.get(P + "n")
    assert p.execute() == [True, 2, 7, b"7"]


# WATCH with redis-py's optimistic retry helper.
def bump(pipe):
    value = int(pipe.get(P + "n"))
    pipe.multi()
    pipe.set(P + "n", value + 1)


r.transaction(bump, P + "n")
assert r.get(P + "n") == b"8"

# A watched key changed by another client: EXEC runs nothing and redis-py says so.
other = redis.Redis(host=host, port=int(port))
with r.pipeline() as p:
    p.watch(P + "n")
    other.set(P + "n", 100)
    p.multi()
    p.set(P + "n", 0)
    try:
        p.execute()
        raise AssertionError("EXEC ran although a watched key changed")
    except redis.WatchError:
        pass
assert r.get(P + "n") == b"100"

print(f"redis-py {redis.__version__} ok (RESP {protocol})")
