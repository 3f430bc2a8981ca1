"""A machine's side of interactive sessions (`capabilities.interactive_token`).

Set-up, before the worker starts: the attempt's session directory `<agent data dir>/interactive/<attempt>/` is made;
a machine whose agent hosts no sessions (`--no-interactive-sessions`), or that cannot make it, fails the attempt
with "Interactive token: <why>". Then, while it runs, `grant` keeps the public key of each token issued for the
attempt with its expiry (`grants.json`, public), and `attach` runs a command in the attempt for a request signed by
a granted token that has not expired, within a minute of this machine's clock and never twice
(`activities/session_token.py` says why nothing a history holds lets its reader attach).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from activities.agent.runtime.base import ExecRefused, Executed, Runtime, RuntimeFailure, forget_attempts
from activities.agent.runtime.shim import write_atomically
from activities.session_token import verify
from workflows.domain.reasons import R
from workflows.domain.refs import TaskRef
from workflows.messages import SESSION_OUTPUT_MAX_BYTES, Attached, AttachInput

NO_SESSIONS = "this machine hosts no interactive sessions (its agent was started with --no-interactive-sessions)"
SIGNED_WITHIN = timedelta(seconds=60)  # a request signed longer ago (or ahead) than this is refused


class SessionRefused(Exception):
    """A grant or a command this machine refuses; the message says why, for the person who asked."""


def _utc(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Sessions:
    def __init__(self, runtime: Runtime, data_dir: Path, node: str, hosts: bool = True) -> None:
        self._runtime = runtime
        self.root = data_dir / "interactive"
        self._node = node
        self.hosts = hosts  # whether this machine hosts sessions at all (--no-interactive-sessions: not)
        self._lock = threading.Lock()  # grants.json and the nonces seen are read and written whole
        self._seen: dict[str, datetime] = {}  # nonces of requests run, with when they were signed

    def directory(self, key: TaskRef) -> Path:
        return self.root / key.slug

    def set_up(self, key: TaskRef) -> None:
        """Make the attempt ready for sessions before it starts, or fail it with "Interactive token: <why>"."""
        if not self.hosts:
            raise RuntimeFailure(R.InteractiveTokenFailed(why=NO_SESSIONS))
        directory = self.directory(key)
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not (directory / "grants.json").exists():
                write_atomically(directory / "grants.json", "{}")
        except OSError as err:
            why = f"cannot keep the attempt's tokens in {directory}: {err.strerror or err}"
            raise RuntimeFailure(R.InteractiveTokenFailed(why=why)) from None

    def forget(self, keep: Iterable[str]) -> None:
        """Remove the grants of every attempt but those in `keep` (slugs): an ended attempt's tokens end with it."""
        forget_attempts(self.root, keep)

    def grant(self, key: TaskRef, public_key: str, ttl_seconds: int, now: datetime) -> datetime:
        """Let the holder of the token with this public key attach until it expires; returns when."""
        self._grants(key)
        self._running(key)
        expires = now + timedelta(seconds=ttl_seconds)
        with self._lock:
            grants = self._grants(key)
            grants[public_key] = expires.isoformat()
            write_atomically(self.directory(key) / "grants.json", json.dumps(grants))
        return expires

    def attach(self, key: TaskRef, request: AttachInput, now: datetime) -> Attached:
        """Run the request's command in the attempt, once its token and signature are checked."""
        self._check(key, request, now)
        self._running(key)
        try:
            done = self._runtime.exec(key, request.argv, request.stdin.encode(), request.timeout_seconds)
        except ExecRefused as err:
            raise SessionRefused(
                f"cannot run {request.argv[0]} in worker {key.task_id} on {self._node}: {err}"
            ) from None
        return _attached(done)

    # ---- checks -------------------------------------------------------------------------------------------------

    def _grants(self, key: TaskRef) -> dict[str, str]:
        try:
            grants: dict[str, str] = json.loads((self.directory(key) / "grants.json").read_text())
        except FileNotFoundError:
            raise SessionRefused(
                f"worker {key.task_id} (attempt {key.attempt}) on {self._node} hosts no interactive sessions "
                "(its group does not ask capabilities.interactive_token, or this attempt was not set up here)"
            ) from None
        return grants

    def _running(self, key: TaskRef) -> None:
        if not self._runtime.observe(key).running:
            raise SessionRefused(f"worker {key.task_id} (attempt {key.attempt}) is not running on {self._node}")

    def _check(self, key: TaskRef, request: AttachInput, now: datetime) -> None:
        expires = self._grants(key).get(request.public_key)
        if expires is None:
            raise SessionRefused(f"token refused: it was not issued for worker {key.task_id} (attempt {key.attempt})")
        if now >= datetime.fromisoformat(expires):
            raise SessionRefused(f"token refused: it expired at {_utc(datetime.fromisoformat(expires))}")
        if not verify(request):
            raise SessionRefused("token refused: the request's signature does not match its token")
        if abs(now - request.signed_at) > SIGNED_WITHIN:
            raise SessionRefused(
                f"token refused: the request was signed at {_utc(request.signed_at)}, more than "
                f"{SIGNED_WITHIN.seconds} s from this machine's clock ({_utc(now)})"
            )
        with self._lock:
            self._seen = {n: at for n, at in self._seen.items() if now - at <= 2 * SIGNED_WITHIN}
            if request.nonce in self._seen:
                raise SessionRefused("token refused: this request was run already (each is run once)")
            self._seen[request.nonce] = request.signed_at


def _cut(data: bytes) -> tuple[str, bool]:
    """The end of an output, at most SESSION_OUTPUT_MAX_BYTES of it, as text."""
    cut = len(data) > SESSION_OUTPUT_MAX_BYTES
    return data[-SESSION_OUTPUT_MAX_BYTES:].decode(errors="replace"), cut


def _attached(done: Executed) -> Attached:
    out, out_cut = _cut(done.stdout)
    err, err_cut = _cut(done.stderr)
    return Attached(exit_code=done.exit_code, stdout=out, stderr=err, cut=out_cut or err_cut)
