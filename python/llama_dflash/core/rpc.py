"""A target's layers on other hosts through llama.cpp's RPC backend (``rpc-server``).

``Cluster("host:port,host:port")`` checks every server (reachable, same RPC protocol as this
llama.cpp), puts a guard in front of each (``csrc/dflash_rpc.c``: ggml-rpc aborts the process when
a server disconnects; behind the guard a lost or silent server is a counted failure instead) and
registers the guards' endpoints with ggml's RPC backend.  ``apply(model_params)`` then points a
model at those devices only: llama.cpp offloads ``n_gpu_layers`` to them, split as it splits over
GPUs; the rest (and the drafter) stays local.  ``check()`` after a decode raises ``RPCError`` when
a server was lost meanwhile: what that decode produced is garbage and must be discarded.

``RPCServer`` starts and stops an ``rpc-server`` process (tests, benchmarks): the binary
``scripts/setup.sh --rpc`` built from the same llama.cpp (``$LLAMA_DFLASH_RPC_SERVER``, else the
cache's ``bin/rpc-server``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .. import _native, options
from .._native import ffi, lib
from ..cache import files_dir
from ..errors import DFlashError

DEFAULT_TIMEOUT_S = 60.0
INSTALL_HINT = "install the RPC build with scripts/setup.sh --rpc (llama.cpp built with -DGGML_RPC=ON)"


class RPCError(DFlashError):
    """An RPC server that is unreachable, of another protocol, out of memory, or lost mid-stream."""


def available() -> bool:
    """Whether the loaded libggml has llama.cpp's RPC backend."""
    return bool(lib.dflash_rpc_available())


def client_version() -> tuple[int, int, int]:
    v = ffi.new("int32_t[3]")
    lib.dflash_rpc_client_version(v)
    return (v[0], v[1], v[2])


def parse_endpoints(spec: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` (or a list of such strings) -> [(host, port)]; ValueError with one line
    (the ``rpc_servers`` option's own check: ``options.parse_endpoints``)."""
    return options.parse_endpoints(spec)


def drafter_server(rpc_servers: str | Sequence[str] | None, rpc_drafter: str | None) -> int | None:
    """Which of rpc_servers the rpc_drafter option names (its index), None for none; ValueError with
    one line when it names another endpoint or there are no servers."""
    if rpc_drafter is None:
        return None
    if rpc_servers is None:
        raise ValueError("rpc_drafter needs rpc_servers (the drafter goes to one of them)")
    want = options.check("rpc_drafter", rpc_drafter)
    eps = [options.check("rpc_drafter", f"{h}:{p}") for h, p in parse_endpoints(rpc_servers)]
    if want not in eps:
        raise ValueError(f"rpc_drafter {rpc_drafter!r} is not one of the rpc servers ({', '.join(eps)})")
    return eps.index(want)


def probe(host: str, port: int, timeout_s: float = 10.0) -> tuple[int, int, int]:
    """Connect and handshake only: the server's RPC protocol version; RPCError with one line."""
    v = ffi.new("int32_t[3]")
    err = _native.err_buf()
    if lib.dflash_rpc_probe(host.encode(), int(port), float(timeout_s), v, err, _native.ERR_LEN) != 0:
        raise RPCError(_native.err_str(err))
    return (v[0], v[1], v[2])


class _Guard:
    """One guard and its registered devices; lives as long as the process (ggml's registry keeps
    the devices registered with the guard's endpoint for ever)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        err = _native.err_buf()
        g = lib.dflash_rpc_guard_new(host.encode(), port, float(timeout_s), err, _native.ERR_LEN)
        if g == ffi.NULL:
            raise RPCError(_native.err_str(err))
        self.handle = g
        self.endpoint = f"{host}:{port}"
        self.local = f"127.0.0.1:{lib.dflash_rpc_guard_port(g)}"
        reg = lib.dflash_rpc_add_server(self.local.encode(), err, _native.ERR_LEN)
        if reg == ffi.NULL:
            raise RPCError(_native.err_str(err))
        devs = ffi.new("void *[16]")
        n = lib.dflash_rpc_devices(reg, devs, 16)
        if n <= 0:
            raise RPCError(f"rpc server {self.endpoint} offers no device")
        self.devices = [int(ffi.cast("uintptr_t", devs[i])) for i in range(min(n, 16))]

    def failures(self) -> tuple[int, str]:
        err = _native.err_buf()
        n = int(lib.dflash_rpc_guard_failures(self.handle, err, _native.ERR_LEN))
        return n, (_native.err_str(err) if n else "")

    def alloc_failures(self) -> int:
        return int(lib.dflash_rpc_guard_alloc_failures(self.handle))

    def traffic(self) -> dict:
        v = ffi.new("int64_t[6]")
        lib.dflash_rpc_guard_traffic(self.handle, v)
        return {"requests": int(v[0]), "bytes_up": int(v[1]), "bytes_down": int(v[2]),
                "read_ahead_used": int(v[3]), "read_ahead_dropped": int(v[4]),
                "waited": int(v[5]) - int(v[3])}


_guards: dict[tuple[str, int], _Guard] = {}
_lock = threading.Lock()


class Cluster:
    """The RPC servers a target is split over (see the module's doc).

    spec: ``"host:port,host:port"`` or a list.  timeout_s: how long a server may take to connect and
    to answer one request (a decode's result included) before it counts as lost.
    """

    def __init__(self, spec: str | Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"rpc timeout must be positive, got {timeout_s}")
        endpoints = parse_endpoints(spec)
        if not available():
            raise RPCError(f"rpc_servers given, but this llama-cpp-python has no RPC backend: {INSTALL_HINT}")
        self.endpoints = [f"{h}:{p}" for h, p in endpoints]
        self.timeout_s = timeout_s
        self.guards: list[_Guard] = []
        with _lock:
            for host, port in endpoints:
                g = _guards.get((host, port))
                if g is None:
                    g = _guards[(host, port)] = _Guard(host, port, timeout_s)
                elif not lib.dflash_rpc_guard_connections(g.handle):
                    # the same one-line errors as a first use (not while a model's connection goes through
                    # the guard: the server serves one client at a time, a probe would wait behind it;
                    # models of one process share that connection)
                    probe(host, port, min(timeout_s, 10.0))
                self.guards.append(g)
        self.devices = [d for g in self.guards for d in g.devices]
        self._devs = (ctypes.c_void_p * (len(self.devices) + 1))(*self.devices, None)
        self._mark = self.failures()
        self._alloc_mark = sum(g.alloc_failures() for g in self.guards)

    def device(self, endpoint: str) -> int:
        """The (first) device of one of these servers, ``host:port`` as given: where a drafter can be
        put (``rpc_drafter``).  ValueError with one line if it is not one of them."""
        return self.guards[drafter_server(self.endpoints, endpoint)].devices[0]

    def placement(self, where: str, rpc_drafter: str | None = None) -> str:
        """The placement key of a target over these servers (``where``: its local part, e.g.
        ``n_gpu_layers=N``) and of a drafter on one of them: what its cost model and exact-mode
        verdict are kept for."""
        return f"rpc={','.join(self.endpoints)};{where}" + (f";drafter={rpc_drafter}" if rpc_drafter else "")

    def apply(self, model_params) -> None:
        """Point a ``llama_model_params`` at these servers' devices only (NULL-terminated list).
        ``n_gpu_layers`` decides how many layers go to them."""
        model_params.devices = ctypes.cast(self._devs, ctypes.c_void_p)

    def failures(self) -> int:
        return sum(g.failures()[0] for g in self.guards)

    def traffic(self) -> list[dict]:
        """Per server so far: the client's requests, bytes sent to / received from it, the tensor
        reads answered from the guard's read-ahead / read ahead in vain, and the requests whose
        answer came from the server (each a round trip the client waited for)."""
        return [g.traffic() for g in self.guards]

    def read_ahead(self, on: bool) -> None:
        """Switch the guards' read-ahead (on by default; ``csrc/dflash_rpc.c``) for these servers, for
        every model of the process that uses them (A/B runs)."""
        for g in self.guards:
            lib.dflash_rpc_guard_read_ahead(g.handle, bool(on))

    def lost(self) -> str | None:
        """The last loss since the last ``mark()`` (a one-line message), or None."""
        if self.failures() == self._mark:
            return None
        msgs = [m for g in self.guards if (m := g.failures()[1])]
        return msgs[-1] if msgs else "an rpc server was lost"

    def mark(self) -> None:
        """From now on ``check`` reports only new losses."""
        self._mark = self.failures()
        self._alloc_mark = sum(g.alloc_failures() for g in self.guards)

    def check(self) -> None:
        """Raise RPCError if a server was lost since the last ``mark()``."""
        msg = self.lost()
        if msg is not None:
            raise RPCError(f"{msg}: the generation was stopped and its tokens discarded "
                           "(the model reloads its layers on the next request)")

    def load_error(self, model_path: str | os.PathLike) -> RPCError:
        """Why a model load over these servers failed, in one line."""
        msg = self.lost()
        if msg is not None:
            return RPCError(f"cannot load {os.fspath(model_path)!r} over RPC: {msg}")
        if sum(g.alloc_failures() for g in self.guards) > self._alloc_mark:
            return RPCError(f"cannot load {os.fspath(model_path)!r}: the rpc servers ({', '.join(self.endpoints)}) "
                            "have not enough memory for its layers (offload fewer with n_gpu_layers, or add servers)")
        return RPCError(f"cannot load {os.fspath(model_path)!r} over RPC ({', '.join(self.endpoints)})")


# ---------------------------------------------------------------------------
# rpc-server processes


def server_binary() -> Path | None:
    """The rpc-server that scripts/setup.sh --rpc built ($LLAMA_DFLASH_RPC_SERVER overrides)."""
    env = os.environ.get("LLAMA_DFLASH_RPC_SERVER")
    if env:
        return Path(env) if os.access(env, os.X_OK) else None
    p = files_dir() / "bin" / "rpc-server"
    if p.exists() and os.access(p, os.X_OK):
        return p.resolve()
    found = shutil.which("rpc-server")
    return Path(found) if found else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class RPCServer:
    """An ``rpc-server`` process on host:port (CPU device, n_threads), started now, ready when this
    returns; ``stop()`` (or the context manager) ends it.  mem_limit_mb caps its address space
    (a host with little memory).  Errors are one line: no binary, port in use, did not start."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", n_threads: int = 1,
                 mem_limit_mb: int | None = None, binary: str | os.PathLike | None = None,
                 timeout_s: float = 30.0) -> None:
        self.proc: subprocess.Popen | None = None
        exe = Path(binary) if binary else server_binary()
        if exe is None or not exe.exists():
            raise RPCError(f"no rpc-server binary: {INSTALL_HINT}")
        self.host = host
        self.port = port or free_port(host)
        self.binary = exe
        self.n_threads = n_threads
        self.mem_limit_mb = mem_limit_mb
        if port_in_use(host, self.port):
            raise RPCError(f"cannot start rpc-server on {host}:{self.port}: the port is already in use")
        self.start(timeout_s)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        """(Re)start the process; returns once it answers the RPC handshake."""
        if self.proc is not None and self.proc.poll() is None:
            return
        limit = self.mem_limit_mb

        def preexec():  # pragma: no cover - runs in the child
            os.setsid()
            if limit:
                import resource
                b = int(limit) << 20
                resource.setrlimit(resource.RLIMIT_AS, (b, b))

        self.proc = subprocess.Popen(
            [str(self.binary), "-H", self.host, "-p", str(self.port), "-t", str(self.n_threads)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=preexec)
        self._out: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        t_end = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = " / ".join(s.strip() for s in self._out[-3:] if s.strip())
                raise RPCError(f"rpc-server on {self.endpoint} exited at start (status {self.proc.returncode})"
                               + (f": {tail}" if tail else ""))
            if self._listening():
                return
            if time.monotonic() > t_end:
                self.stop()
                raise RPCError(f"rpc-server on {self.endpoint} did not start within {timeout_s:.0f} s")
            time.sleep(0.05)

    def _drain(self) -> None:
        proc = self.proc
        for line in iter(proc.stdout.readline, b""):
            self._out.append(line.decode("utf-8", "replace"))
            del self._out[:-50]

    def _listening(self) -> bool:
        # whether a connect succeeds (no handshake: the server serves one client at a time)
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    @property
    def output(self) -> str:
        return "".join(self._out)

    def kill(self) -> None:
        """SIGKILL (a crash), and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> RPCServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
