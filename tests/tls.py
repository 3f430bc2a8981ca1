"""TLS for tests: a CA, a server and a client certificate made with `cryptography`, and a proxy that ends mutual TLS
in front of a plain Temporal dev server (which serves no TLS itself), each connection piped on threads."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "temporal.test"  # the name in the server's certificate, as a profile's server_name gives it


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(folder: Path, at: datetime = datetime(2026, 1, 1, tzinfo=UTC)) -> Certs:
    """A CA, and a server (SERVER_NAME and 127.0.0.1) and a client certificate it signed, valid for ten years
    from `at`, each written as PEM in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "astraeus test CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), at)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": _write(folder / "ca.pem", ca)}
    for role, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"astraeus test {role}")])
        builder = _builder(subject, ca_name, key.public_key(), at).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False
        )
        if role == "server":
            names = [x509.DNSName(SERVER_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        paths[f"{role}_cert"] = _write(folder / f"{role}.pem", builder.sign(ca_key, hashes.SHA256()))
        paths[f"{role}_key"] = folder / f"{role}-key.pem"
        paths[f"{role}_key"].write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption())
        )  # fmt: skip
    return Certs(**paths)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePublicKey, at: datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(at - timedelta(days=1))
        .not_valid_after(at + timedelta(days=3650))
    )


def _write(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


class TlsProxy:
    """Listens on 127.0.0.1 with the server certificate, asks every client for a certificate signed by the CA
    (mutual TLS), speaks HTTP/2 (ALPN h2, as gRPC asks), and pipes what it decrypts to `upstream` (HOST:PORT). It
    runs on an event loop of its own thread, so that a test may block on a subprocess meanwhile."""

    def __init__(self, certs: Certs, upstream: str) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs.ca))
        self.context.load_cert_chain(str(certs.server_cert), str(certs.server_key))
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.context.set_alpn_protocols(["h2"])
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.served = 0  # connections whose handshake passed
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> TlsProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self.listener, ssl=self.context)

    async def _close(self) -> None:
        self._server.close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.served += 1
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    finally:
        with contextlib.suppress(Exception):
            sink.close()
