"""The RPC guard's read-ahead (csrc/dflash_rpc.c), against a scripted server that speaks ggml-rpc's
framing: after a run of GET_TENSORs it has seen, the guard requests the rest of the run right
behind its first GET; an answer read ahead reaches the client only for the identical request with
nothing sent between, so what the client reads is always what the server holds at that moment.
Needs no RPC build (the guard is plain sockets)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from llama_dflash import _native
from llama_dflash._native import ffi, lib

HELLO, FREE_BUFFER, SET_TENSOR, GET_TENSOR, GRAPH_COMPUTE = 14, 4, 6, 8, 10
TENSOR = 296  # sizeof(rpc_tensor) of the pinned ggml-rpc; a GET_TENSOR request is it + offset + size


def get_req(tid: int, size: int = 64) -> bytes:
    return struct.pack("<Q", tid) + bytes(TENSOR - 8) + struct.pack("<QQ", 0, size)


def content(version: int, tid: int, size: int) -> bytes:
    """What the server holds for tensor tid after `version` writes."""
    return bytes((version * 31 + tid * 7 + i) % 251 for i in range(size))


def recv_all(s: socket.socket, n: int) -> bytes:
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise ConnectionError("closed")
        b += c
    return b


class Server:
    """One client at a time, commands in order: SET_TENSOR and GRAPH_COMPUTE change what it holds,
    GET_TENSOR answers it; every request is logged.  die_after: close the connection once that many
    GETs were answered (a server lost with reads still due)."""

    def __init__(self, die_after: int | None = None) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(4)
        self.port = self.srv.getsockname()[1]
        self.version = 0
        self.log: list[tuple[int, int]] = []
        self.die_after = die_after
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.srv.settimeout(0.2)
        while not self.stop.is_set():
            try:
                c, _ = self.srv.accept()
            except OSError:
                continue
            with c:
                try:
                    self._conn(c)
                except (OSError, ConnectionError):
                    pass

    def _conn(self, c: socket.socket) -> None:
        answered = 0
        while True:
            cmd = recv_all(c, 1)[0]
            (size,) = struct.unpack("<Q", recv_all(c, 8))
            payload = recv_all(c, size)
            if cmd == HELLO:
                v = ffi.new("int32_t[3]")
                lib.dflash_rpc_client_version(v)
                c.sendall(struct.pack("<Q", 28) + bytes([v[0], v[1], v[2], 0]) + bytes(24))
                continue
            if cmd == GET_TENSOR:
                tid = struct.unpack("<Q", payload[:8])[0]
                n = struct.unpack("<Q", payload[TENSOR + 8:TENSOR + 16])[0]
                self.log.append((cmd, tid))
                if self.die_after is not None and answered >= self.die_after:
                    return
                c.sendall(struct.pack("<Q", n) + content(self.version, tid, n))
                answered += 1
                continue
            self.log.append((cmd, 0))
            if cmd in (SET_TENSOR, GRAPH_COMPUTE):
                self.version += 1

    def gets(self) -> list[int]:
        return [t for cmd, t in self.log if cmd == GET_TENSOR]

    def close(self) -> None:
        self.stop.set()
        self.srv.close()


class Client:
    """ggml-rpc's side: one request at a time, through the guard."""

    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.s.sendall(bytes([HELLO]) + struct.pack("<Q", 24) + bytes(24))
        (n,) = struct.unpack("<Q", recv_all(self.s, 8))
        recv_all(self.s, n)

    def send(self, cmd: int, payload: bytes = bytes(16)) -> None:
        self.s.sendall(bytes([cmd]) + struct.pack("<Q", len(payload)) + payload)

    def get(self, tid: int, size: int = 64) -> bytes:
        self.send(GET_TENSOR, get_req(tid, size))
        (n,) = struct.unpack("<Q", recv_all(self.s, 8))
        assert n == size
        return recv_all(self.s, n)

    def close(self) -> None:
        self.s.close()


@pytest.fixture()
def rig():
    made = []

    def make(die_after: int | None = None, timeout_s: float = 5.0):
        srv = Server(die_after)
        err = _native.err_buf()
        g = lib.dflash_rpc_guard_new(b"127.0.0.1", srv.port, timeout_s, err, _native.ERR_LEN)
        assert g != ffi.NULL, _native.err_str(err)
        cl = Client(lib.dflash_rpc_guard_port(g))
        made.append((srv, g, cl))
        return srv, g, cl

    yield make
    for srv, g, cl in made:
        cl.close()
        lib.dflash_rpc_guard_free(g)
        srv.close()


def traffic(g) -> dict:
    v = ffi.new("int64_t[6]")
    lib.dflash_rpc_guard_traffic(g, v)
    return {"used": v[3], "dropped": v[4], "answers": v[5]}


def failures(g) -> int:
    return int(lib.dflash_rpc_guard_failures(g, ffi.NULL, 0))


def wait_for(cond, timeout: float = 5.0) -> bool:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_a_run_seen_before_is_read_ahead_and_answers_are_current(rig):
    srv, g, cl = rig()
    for k in range(4):
        cl.send(SET_TENSOR)
        cl.send(GRAPH_COMPUTE)
        for t in (11, 12, 13):
            assert cl.get(t) == content(2 * (k + 1), t, 64)
    # the first run was recorded; the three after it read 12 and 13 ahead of the client's requests
    t = traffic(g)
    assert t["used"] == 6 and t["dropped"] == 0, t
    assert srv.gets() == [11, 12, 13] * 4
    # behind a first GET the rest is requested before the client asks for it
    cl.send(SET_TENSOR)
    before = len(srv.gets())
    assert cl.get(11) == content(9, 11, 64)
    assert wait_for(lambda: srv.gets()[before:] == [11, 12, 13])
    time.sleep(0.2)
    # a write between: the answers read ahead are dropped, the reads see the new contents
    cl.send(SET_TENSOR)
    assert cl.get(12) == content(10, 12, 64)
    assert cl.get(13) == content(10, 13, 64)
    t = traffic(g)
    assert t["dropped"] == 2 and t["used"] == 6, t
    assert failures(g) == 0


def test_another_read_than_the_one_read_ahead(rig):
    srv, g, cl = rig()
    for _ in range(2):
        cl.send(SET_TENSOR)
        for t in (21, 22, 23):
            assert cl.get(t) == content(srv.version, t, 64)
    cl.send(SET_TENSOR)
    assert cl.get(21) == content(3, 21, 64)  # 22, 23 read ahead (used: 22, 23 of the 2nd run: 2)
    assert cl.get(23) == content(3, 23, 64)  # not 22: both dropped, 23 asked again
    assert cl.get(22) == content(3, 22, 64)
    t = traffic(g)
    assert t["used"] == 2 and t["dropped"] == 2, t
    # the new run (21, 23, 22) replaced the old one
    cl.send(SET_TENSOR)
    assert [cl.get(x) for x in (21, 23, 22)] == [content(4, x, 64) for x in (21, 23, 22)]
    assert traffic(g)["used"] == 4
    # a request that differs in any byte (here its size) starts no remembered run
    cl.send(SET_TENSOR)
    before = len(srv.gets())
    assert cl.get(21, 128) == content(5, 21, 128)
    time.sleep(0.2)
    assert srv.gets()[before:] == [21]


def test_freed_buffers_and_the_switch_stop_it(rig):
    srv, g, cl = rig()
    for _ in range(2):
        cl.send(SET_TENSOR)
        cl.get(31)
        cl.get(32)
    assert traffic(g)["used"] == 1
    cl.send(FREE_BUFFER)  # (a GET into a freed buffer would make the server drop the connection)
    before = len(srv.gets())
    cl.get(31)
    time.sleep(0.2)
    assert srv.gets()[before:] == [31]
    cl.get(32)
    # learnt again, then switched off
    cl.send(SET_TENSOR)
    lib.dflash_rpc_guard_read_ahead(g, False)
    before = len(srv.gets())
    cl.get(31)
    time.sleep(0.2)
    assert srv.gets()[before:] == [31]
    assert traffic(g)["used"] == 1


def test_a_server_lost_with_reads_due(rig):
    srv, g, cl = rig(die_after=7, timeout_s=2.0)
    for _ in range(2):
        cl.send(SET_TENSOR)
        for t in (41, 42, 43):
            cl.get(t)
    cl.send(SET_TENSOR)
    # 41 is answered, 42 and 43 were requested ahead but the server closed without answering them
    assert cl.get(41) == content(3, 41, 64)
    t0 = time.monotonic()
    assert cl.get(42) == bytes(64)  # the guard completes the answer with zeros, no hang
    assert cl.get(43) == bytes(64)
    cl.send(SET_TENSOR)
    assert cl.get(41) == bytes(64)
    assert time.monotonic() - t0 < 5
    assert failures(g) >= 1
