"""Who calls the HTTP API: a bearer token's secret, looked up by its digest in the tokens that TokensWorkflow keeps.

Every API process reads the whole table (a few hundred digests at most) with one query and keeps it for a few
seconds, so a request costs no trip to Temporal; a token made or revoked counts everywhere within that time."""

from __future__ import annotations

import asyncio
import time

from temporalio.client import Client

from workers.admin import tokens
from workflows.domain.tokens import Token, digest

FRESH_SECONDS = 2.0  # how long a read of the table is used; a revoked token is refused at most this long after
MISS_SECONDS = 0.5  # an unknown token reads the table again when the last read is older: a new token works at once


class TokenBook:
    """The tokens, as TokensWorkflow last said, by digest."""

    def __init__(
        self, client: Client, fresh_seconds: float = FRESH_SECONDS, miss_seconds: float = MISS_SECONDS
    ) -> None:
        self._client = client
        self._fresh = fresh_seconds
        self._miss = miss_seconds
        self._by_digest: dict[str, Token] = {}
        self._read_at: float | None = None
        self._lock = asyncio.Lock()  # one read at a time: the requests that come meanwhile use it

    async def find(self, secret: str) -> Token | None:
        """The token whose secret this is, or None. Bad tokens cost at most one read of the table per MISS_SECONDS."""
        if not secret:
            return None
        wanted = digest(secret)
        async with self._lock:
            age = None if self._read_at is None else time.monotonic() - self._read_at
            if age is None or age > self._fresh or (wanted not in self._by_digest and age > self._miss):
                self._by_digest = {t.sha256: t for t in await tokens(self._client)}
                self._read_at = time.monotonic()
        return self._by_digest.get(wanted)
