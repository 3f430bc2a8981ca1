"""A real all-reduce over plain TCP among WORLD_SIZE workers, with nothing but the standard library (Python 3.10+).

It reads what distributed launchers set: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a gang's workers get
them from Astraeus). Rank 0 listens on MASTER_ADDR:MASTER_PORT; every other rank connects (retrying while the
leader is not up yet) and sends its vector; rank 0 sums them and sends the sum back (a star all-reduce). Every
rank checks the sum against the one expected for WORLD_SIZE ranks and prints

    rank 2/4: all-reduce ok: [10.0, 20.0, 30.0, 40.0]

Rank r contributes (r + 1) * (i + 1) at index i, so the sum at index i is (i + 1) * W * (W + 1) / 2: whole
numbers, exact in floating point. Exit codes: 0 all-reduce ok, 1 failed (a wrong sum, a timeout, a peer that
disagrees or hangs up), 2 bad environment or arguments.

Its very first action appends `<rank> <time.time()>` to the file ALLREDUCE_START_LOG names, when set: a test
reads it to check that no member of a gang started before every member was ready.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python3 activities/agent/runtime/programs/allreduce.py &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python3 activities/agent/runtime/programs/allreduce.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass

EXIT_FAILED = 1
EXIT_USAGE = 2

_LENGTH = struct.Struct("!I")  # every message: its length, then its bytes
_HELLO = struct.Struct("!III")  # a worker's first message: rank, world size, vector size
_MAX_MESSAGE = 64 * 1024 * 1024
_VECTOR, _ERROR = b"V", b"E"  # the first byte of a message after the hello: a vector of doubles, or an error
_RETRY_SECONDS = 0.2


class Failed(Exception):
    """The all-reduce failed: exit 1 with this message."""


class BadUsage(Exception):
    """The environment or the arguments are wrong: exit 2 with this message."""


@dataclass(frozen=True)
class Config:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    size: int
    timeout: float

    @property
    def who(self) -> str:
        return f"rank {self.rank}/{self.world_size}"


def contribution(rank: int, size: int) -> list[float]:
    """What rank `rank` puts in: (rank + 1) * (i + 1) at index i."""
    return [float((rank + 1) * (i + 1)) for i in range(size)]


def expected_sum(world_size: int, size: int) -> list[float]:
    """The all-reduced vector of `world_size` ranks."""
    return [float((i + 1) * world_size * (world_size + 1) // 2) for i in range(size)]


def _int_env(env: dict[str, str], name: str) -> int:
    value = env.get(name)
    if value is None or value == "":
        raise BadUsage(f"missing environment variable {name} (set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    try:
        return int(value)
    except ValueError:
        raise BadUsage(f"{name}={value!r} is not an integer") from None


def config_from(env: dict[str, str], argv: list[str]) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size", type=int, default=4, help="values per rank (default 4)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the others (default 60)")
    args = parser.parse_args(argv)
    if args.size < 1:
        raise BadUsage(f"--size {args.size}: need at least one value")
    if args.timeout <= 0:
        raise BadUsage(f"--timeout {args.timeout:g}: need a positive number of seconds")
    world_size = _int_env(env, "WORLD_SIZE")
    rank = _int_env(env, "RANK")
    if world_size < 1:
        raise BadUsage(f"WORLD_SIZE={world_size}: need at least 1")
    if not 0 <= rank < world_size:
        raise BadUsage(f"RANK={rank} is not in 0..{world_size - 1} (WORLD_SIZE={world_size})")
    if world_size == 1:  # alone: nobody to reach, so no address is needed
        return Config(rank, world_size, env.get("MASTER_ADDR", ""), 0, args.size, args.timeout)
    master_addr = env.get("MASTER_ADDR", "")
    if not master_addr:
        raise BadUsage("missing environment variable MASTER_ADDR (set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    master_port = _int_env(env, "MASTER_PORT")
    if not 0 < master_port < 65536:
        raise BadUsage(f"MASTER_PORT={master_port} is not a TCP port (1..65535)")
    return Config(rank, world_size, master_addr, master_port, args.size, args.timeout)


# ---- framing --------------------------------------------------------------------------------------------------


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, count: int, peer: str) -> bytes:
    chunks: list[bytes] = []
    left = count
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except TimeoutError:
            raise Failed(f"timed out waiting for {peer}") from None
        except OSError as err:
            raise Failed(f"lost the connection to {peer}: {err}") from None
        if not chunk:
            raise Failed(f"{peer} closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, peer: str) -> bytes:
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, peer))
    if length > _MAX_MESSAGE:
        raise Failed(f"{peer} sent a message of {length} bytes, more than {_MAX_MESSAGE}")
    return _recv_exact(sock, length, peer)


def _pack_vector(values: list[float]) -> bytes:
    return _VECTOR + struct.pack(f"!{len(values)}d", *values)


def _unpack_vector(payload: bytes, size: int, peer: str) -> list[float]:
    if payload[:1] == _ERROR:
        raise Failed(f"{peer} reports: {payload[1:].decode('utf-8', errors='replace')}")
    if payload[:1] != _VECTOR or len(payload) != 1 + 8 * size:
        raise Failed(f"{peer} sent {len(payload)} bytes, not a vector of {size} values")
    return list(struct.unpack(f"!{size}d", payload[1:]))


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


# ---- the all-reduce -------------------------------------------------------------------------------------------


def _listen(config: Config) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            config.master_addr, config.master_port, type=socket.SOCK_STREAM
        )[0]
        server = socket.socket(family, kind, proto)
    except OSError as err:
        raise BadUsage(f"cannot listen on {config.master_addr}:{config.master_port}: {err}") from None
    try:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(address)
        server.listen(config.world_size)
    except OSError as err:
        server.close()
        raise Failed(f"cannot listen on {config.master_addr}:{config.master_port}: {err}") from None
    return server


def _lead(config: Config, deadline: float) -> list[float]:
    """Rank 0: take every other rank's vector, sum them with ours, and send the sum to each."""
    total = contribution(0, config.size)
    peers: dict[int, socket.socket] = {}
    with _listen(config) as server:
        try:
            while len(peers) < config.world_size - 1:
                server.settimeout(_remaining(deadline))
                try:
                    conn, address = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, config.world_size)) - set(peers))
                    raise Failed(f"timed out waiting for rank(s) {missing} to connect") from None
                conn.settimeout(_remaining(deadline))
                peer = f"the worker at {address[0]}:{address[1]}"
                try:
                    hello = _recv(conn, peer)
                    if len(hello) != _HELLO.size:
                        raise Failed(f"{peer} did not introduce itself (is it this program?)")
                    rank, world_size, size = _HELLO.unpack(hello)
                    problem = _disagreement(config, rank, world_size, size, peers)
                    if problem:
                        _send(conn, _ERROR + problem.encode())
                        raise Failed(problem)
                    peers[rank] = conn
                    values = _unpack_vector(_recv(conn, f"rank {rank}"), config.size, f"rank {rank}")
                except BaseException:
                    conn.close()
                    raise
                total = [a + b for a, b in zip(total, values, strict=True)]
            reply = _pack_vector(total)
            for rank, conn in sorted(peers.items()):
                try:
                    _send(conn, reply)
                except OSError as err:
                    raise Failed(f"cannot send the sum to rank {rank}: {err}") from None
            return total
        except Failed as failure:
            for conn in peers.values():  # tell the others why, so that they do not wait for a sum
                with contextlib.suppress(OSError):
                    _send(conn, _ERROR + f"rank 0 failed: {failure}".encode())
            raise
        finally:
            for conn in peers.values():
                conn.close()


def _disagreement(config: Config, rank: int, world_size: int, size: int, peers: dict[int, socket.socket]) -> str:
    if world_size != config.world_size:
        return f"rank {rank} has WORLD_SIZE={world_size}, rank 0 has WORLD_SIZE={config.world_size}"
    if size != config.size:
        return f"rank {rank} sends {size} values, rank 0 expects {config.size} (--size)"
    if not 0 < rank < config.world_size:
        return f"a worker says it is rank {rank}, not in 1..{config.world_size - 1}"
    if rank in peers:
        return f"two workers say they are rank {rank}"
    return ""


def _connect(config: Config, deadline: float) -> socket.socket:
    """Connect to rank 0, retrying until the deadline: the leader may start a moment after us."""
    last_error: OSError | None = None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection(
                (config.master_addr, config.master_port), timeout=min(_remaining(deadline), 5.0)
            )
        except OSError as err:
            last_error = err
            time.sleep(min(_RETRY_SECONDS, _remaining(deadline)))
    raise Failed(
        f"could not reach rank 0 at {config.master_addr}:{config.master_port} within {config.timeout:g} s "
        f"({last_error})"
    )


def _follow(config: Config, deadline: float) -> list[float]:
    """Any other rank: send our vector to rank 0 and take the sum back."""
    with _connect(config, deadline) as sock:
        sock.settimeout(_remaining(deadline))
        try:
            _send(sock, _HELLO.pack(config.rank, config.world_size, config.size))
            _send(sock, _pack_vector(contribution(config.rank, config.size)))
        except OSError as err:
            raise Failed(f"cannot send to rank 0: {err}") from None
        return _unpack_vector(_recv(sock, "rank 0"), config.size, "rank 0")


def all_reduce(config: Config) -> list[float]:
    deadline = time.monotonic() + config.timeout
    if config.world_size == 1:
        return contribution(0, config.size)
    if config.rank == 0:
        return _lead(config, deadline)
    return _follow(config, deadline)


def record_start() -> float:
    """Append `<rank> <time.time()>` to the file ALLREDUCE_START_LOG names, if set; return the time."""
    started_at = time.time()
    path = os.environ.get("ALLREDUCE_START_LOG")
    if path:
        with open(path, "a") as log:  # one short write in append mode: lines of concurrent ranks do not mix
            log.write(f"{os.environ.get('RANK', '?')} {started_at!r}\n")
    return started_at


def _say(line: str, error: bool = False) -> None:
    out = sys.stderr if error else sys.stdout
    out.write(line + "\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    started_at = record_start()  # first, before anything can fail
    who = f"rank {os.environ.get('RANK', '?')}/{os.environ.get('WORLD_SIZE', '?')}"
    _say(f"{who}: started at {started_at:.6f} (pid {os.getpid()})")
    try:
        config = config_from(dict(os.environ), sys.argv[1:] if argv is None else argv)
    except BadUsage as err:
        _say(f"{who}: bad environment or arguments: {err}", error=True)
        return EXIT_USAGE
    try:
        result = all_reduce(config)
    except BadUsage as err:
        _say(f"{config.who}: bad environment or arguments: {err}", error=True)
        return EXIT_USAGE
    except Failed as err:
        _say(f"{config.who}: all-reduce failed: {err}", error=True)
        return EXIT_FAILED
    expected = expected_sum(config.world_size, config.size)
    if result != expected:
        _say(f"{config.who}: all-reduce MISMATCH: got {result}, expected {expected}", error=True)
        return EXIT_FAILED
    _say(f"{config.who}: all-reduce ok: {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
