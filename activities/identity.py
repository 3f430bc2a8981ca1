"""Worker identities: X.509 certificates naming a worker's workspace, run, worker and attempt (a SPIFFE ID as the
URI of the certificate), issued by the cluster's own CA. The one module that imports `cryptography`.

The CA (`ClusterCA`) lives with the control plane, in a directory of its own (`astraeus control --ca-dir`, made on
first use, its key readable by its owner only): its key is read there by the activity that signs, and never leaves
that process, so it never enters a history. A machine makes each attempt's key itself (`AttemptIdentity`) and
sends only a certificate request; the certificate that comes back, the key and the CA's certificate are written
to the attempt's identity directory, which the worker is given.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TRUST_DOMAIN = "astraeus"
CA_KEY, CA_CERT = "ca.key", "ca.pem"
CA_YEARS = 10
# The files of an attempt's identity, in its identity directory, and the variables that name them.
KEY_FILE, CERT_FILE, BUNDLE_FILE = "key.pem", "cert.pem", "bundle.pem"
VARIABLES = {"ASTRAEUS_IDENTITY_KEY": KEY_FILE, "ASTRAEUS_IDENTITY_CERT": CERT_FILE,
             "ASTRAEUS_IDENTITY_BUNDLE": BUNDLE_FILE}  # fmt: skip
# A CA's key usage: certificates and revocation lists, nothing else.
SIGNS_CERTIFICATES = x509.KeyUsage(
    digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
    key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
)  # fmt: skip
SKEW = timedelta(minutes=1)  # a certificate is valid from a minute before it was issued: clocks differ


class IdentityRefused(Exception):
    """The CA will not sign this request; the message says why."""


def spiffe_id(namespace: str, run: str, task: str, attempt: int) -> str:
    """The attempt's identity: spiffe://astraeus/ns/<ns>/run/<run>/worker/<task>/attempt/<n>."""
    return f"spiffe://{TRUST_DOMAIN}/ns/{namespace}/run/{run}/worker/{task}/attempt/{attempt}"


class ClusterCA:
    """The cluster's CA in `directory`: made on first use (an EC P-256 key and a self-signed certificate)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def certificate_pem(self) -> bytes:
        self.ensure()
        return (self.directory / CA_CERT).read_bytes()

    def ensure(self) -> bool:
        """Make the CA unless it exists; whether this call made it. Safe between processes (a lock file)."""
        if (self.directory / CA_CERT).exists():
            return False
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _locked(self.directory / ".lock"):
            if (self.directory / CA_CERT).exists():
                return False
            key = ec.generate_private_key(ec.SECP256R1())
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Astraeus cluster CA")])
            now = datetime.now(UTC)
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - SKEW)
                .not_valid_after(now + timedelta(days=365 * CA_YEARS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
                )
                .sign(key, hashes.SHA256())
            )
            pem = key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            _write_private(self.directory / CA_KEY, pem)
            _write_file(self.directory / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
            return True

    def sign(self, csr_pem: bytes, identity: str, ttl: timedelta, now: datetime) -> bytes:
        """A certificate for the request's key, naming `identity` (its URI) and valid for `ttl`. Raises
        IdentityRefused when the request is not signed by its key or names another identity."""
        self.ensure()
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as error:
            raise IdentityRefused(f"not a certificate request: {error}") from None
        if not csr.is_signature_valid:
            raise IdentityRefused("the request is not signed by its own key")
        try:
            asked = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            uris = asked.get_values_for_type(x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            uris = []
        if uris != [identity]:
            raise IdentityRefused(f"the request names {', '.join(uris) or 'no identity'}, not {identity}")
        key = serialization.load_pem_private_key((self.directory / CA_KEY).read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        issuer = x509.load_pem_x509_certificate((self.directory / CA_CERT).read_bytes())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(issuer.subject)
            .public_key(csr.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - SKEW)
            .not_valid_after(now + ttl)
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), critical=True)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Validity:
    """When a certificate's life began and ends."""

    begins: datetime
    ends: datetime

    def renew_after(self) -> datetime:
        """Half its life from its issue (its validity begins SKEW earlier): renewed then, so that a worker never
        holds an expired one while its CA answers."""
        issued = self.begins + SKEW
        return issued + (self.ends - issued) / 2


def validity(cert_pem: bytes) -> Validity:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return Validity(cert.not_valid_before_utc, cert.not_valid_after_utc)


def identity_of(cert_pem: bytes) -> str:
    """The SPIFFE ID a certificate names."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return str(san.get_values_for_type(x509.UniformResourceIdentifier)[0])


class AttemptIdentity:
    """One attempt's identity directory on its machine: its key (made here, never sent), its certificate and the
    CA's certificate."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def request(self, identity: str) -> bytes:
        """A certificate request for `identity`, signed by the attempt's key (made on first use)."""
        key_file = self.directory / KEY_FILE
        if not key_file.exists():
            # The machine's identity root is its agent's alone; an attempt's directory is mounted whole into its
            # container (a renewed certificate replaces the file, which a file mount would not show), and its
            # files are readable by whichever user the worker runs as, as secrets given as files are.
            self.directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.directory.mkdir(exist_ok=True, mode=0o755)
            key = ec.generate_private_key(ec.SECP256R1())
            _write_file(key_file, key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ), mode=0o444)  # fmt: skip
        loaded = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
        assert isinstance(loaded, ec.EllipticCurvePrivateKey)
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([]))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), critical=True)
            .sign(loaded, hashes.SHA256())
        )
        return csr.public_bytes(serialization.Encoding.PEM)

    def keep(self, cert_pem: bytes, bundle_pem: bytes) -> None:
        """Write the certificate and the CA's; each file is replaced whole, so a worker never reads half of one."""
        _write_file(self.directory / BUNDLE_FILE, bundle_pem, mode=0o444)
        _write_file(self.directory / CERT_FILE, cert_pem, mode=0o444)

    def validity(self) -> Validity | None:
        """Its certificate's, or None while it has none."""
        try:
            return validity((self.directory / CERT_FILE).read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    def files(self, root: str) -> dict[str, str]:
        """The variables naming its files, as the worker sees them under `root`."""
        return {name: f"{root.rstrip('/')}/{file}" for name, file in VARIABLES.items()}


def _write_private(path: Path, data: bytes) -> None:
    """A key: readable by its owner only, from its first byte."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _write_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
