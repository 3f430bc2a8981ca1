"""API tokens: who may call the HTTP API, and for which workspace. A token is kept only as the SHA-256 of its
secret, which is random (256 bits), so a slow password hash buys nothing; the secret is shown once, when made."""

from __future__ import annotations

import hashlib
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from workflows.domain.group_parts import Name

TOKEN_ID_PATTERN = r"^tok-[0-9a-f]{8}$"


class Token(BaseModel):
    """One token: its id (to list and revoke it), the workspace it belongs to (None: an admin token, for every
    workspace and for changing machines and quotas), the digest of its secret, when it was made, and a note."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=TOKEN_ID_PATTERN)
    namespace: Name | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    created_at: datetime
    note: str = Field(default="", max_length=256)

    @property
    def admin(self) -> bool:
        return self.namespace is None


def digest(secret: str) -> str:
    """What is kept of a token's secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def may_see(token: Token, namespace: str) -> bool:
    """A workspace token sees its own workspace's runs only; an admin token sees every one."""
    return token.namespace is None or token.namespace == namespace
