"""Interactive tokens: the key a person holds to run commands in one attempt of a worker (`astraeus attach`).

A token is an Ed25519 private key, made where the person asks for it (`astraeus interactive-token`) and never sent
anywhere: its machine is told only the public key (`grant_session`), and each command a person runs is a request
signed with the token (`attach_session`), which the machine checks against the keys granted for that attempt. So no
workflow's history, the run's or the session's, holds anything that would let its reader attach: a signed request
names its command and a nonce, and the machine runs each nonce once, within a minute of when it was signed.
"""

from __future__ import annotations

import base64
import binascii
import json

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from workflows.messages import AttachInput

PREFIX = "astraeus-it-"  # says what it is where it is pasted (a shell history, a ticket)


class BadToken(ValueError):
    """A string that is no interactive token."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_token() -> str:
    """A new token: a private key, as text a person can copy."""
    seed = Ed25519PrivateKey.generate().private_bytes_raw()
    return PREFIX + _b64(seed)


def _private(token: str) -> Ed25519PrivateKey:
    if not token.startswith(PREFIX):
        raise BadToken(f"not an interactive token (it should begin with {PREFIX})")
    try:
        return Ed25519PrivateKey.from_private_bytes(_unb64(token.removeprefix(PREFIX)))
    except (ValueError, binascii.Error):
        raise BadToken("not an interactive token (it is cut short or altered)") from None


def public_key(token: str) -> str:
    """The public half of a token: what its machine is told when it is granted."""
    return _b64(_private(token).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


def signed_bytes(request: AttachInput) -> bytes:
    """What a request's signature covers: every field but the signature, in one canonical form."""
    fields = request.model_dump(mode="json", exclude={"signature"})
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign(token: str, request: AttachInput) -> AttachInput:
    """The request, with its public key and its signature by the token."""
    request = request.model_copy(update={"public_key": public_key(token)})
    return request.model_copy(update={"signature": _b64(_private(token).sign(signed_bytes(request)))})


def verify(request: AttachInput) -> bool:
    """Whether the request was signed by the private half of its public key."""
    try:
        key = Ed25519PublicKey.from_public_bytes(_unb64(request.public_key))
        key.verify(_unb64(request.signature), signed_bytes(request))
    except (InvalidSignature, ValueError, binascii.Error):
        return False
    return True
