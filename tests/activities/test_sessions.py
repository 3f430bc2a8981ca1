"""A machine's side of interactive sessions, on the real process runtime: a worker's attempt is set up for sessions,
a token's public key is granted for it, and a signed request runs a command in the worker (its environment, its
directory); a token of another attempt, an expired one, a request signed by another token, an old request and one
run twice are refused, each saying why."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from activities import session_token
from activities.agent.runtime.base import Launch, RuntimeFailure
from activities.agent.runtime.process import ProcessRuntime
from activities.agent.sessions import NO_SESSIONS, SessionRefused, Sessions
from tests.activities.runtimes import kill_attempts
from workflows.domain.refs import TaskRef
from workflows.messages import AttachInput

NOW = datetime(2026, 12, 1, 20, 0, tzinfo=UTC)
KEY = TaskRef(namespace="default", job="shell", task_id="w-0", attempt=0)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[ProcessRuntime, Sessions]]:
    runtime = ProcessRuntime(tmp_path / "attempts")
    sessions = Sessions(runtime, tmp_path / "agent", "m0")
    sessions.set_up(KEY)
    runtime.start(KEY, Launch(command=["sleep", "60"], env={"GREETING": "hello"}))
    try:
        yield runtime, sessions
    finally:
        kill_attempts(tmp_path / "attempts")


def request(token: str, argv: list[str], stdin: str = "", signed_at: datetime = NOW, key: TaskRef = KEY) -> AttachInput:
    ref = TaskRef(namespace=key.namespace, job=key.job, task_id=key.task_id, attempt=key.attempt)
    unsigned = AttachInput(ref=ref, argv=argv, stdin=stdin, nonce=uuid.uuid4().hex, signed_at=signed_at)
    return session_token.sign(token, unsigned)


def test_a_granted_token_runs_a_command_in_the_worker(running: tuple[ProcessRuntime, Sessions]) -> None:
    _, sessions = running
    token = session_token.new_token()
    assert sessions.grant(KEY, session_token.public_key(token), 60, NOW) == NOW + timedelta(seconds=60)
    done = sessions.attach(KEY, request(token, ["sh", "-c", 'echo "$GREETING" $ASTRAEUS_TASK; echo oops >&2']), NOW)
    assert (done.exit_code, done.stdout, done.stderr) == (0, "hello w-0\n", "oops\n")
    shell = sessions.attach(KEY, request(token, ["sh"], stdin="echo from stdin\nexit 3\n"), NOW)
    assert (shell.exit_code, shell.stdout) == (3, "from stdin\n")


def test_what_is_not_a_granted_token_s_fresh_request_is_refused(running: tuple[ProcessRuntime, Sessions]) -> None:
    _, sessions = running
    token, other = session_token.new_token(), session_token.new_token()
    sessions.grant(KEY, session_token.public_key(token), 60, NOW)

    def refused(attach: AttachInput, at: datetime = NOW) -> str:
        with pytest.raises(SessionRefused) as raised:
            sessions.attach(KEY, attach, at)
        return str(raised.value)

    assert refused(request(other, ["true"])) == "token refused: it was not issued for worker w-0 (attempt 0)"
    later = NOW + timedelta(seconds=61)
    expired = refused(request(token, ["true"], signed_at=later), later)
    assert expired == "token refused: it expired at 2026-12-01 20:01:00 UTC"
    forged = request(other, ["true"]).model_copy(update={"public_key": session_token.public_key(token)})
    assert refused(forged) == "token refused: the request's signature does not match its token"
    old = refused(request(token, ["true"], signed_at=NOW - timedelta(seconds=90)))
    assert old == (
        "token refused: the request was signed at 2026-12-01 19:58:30 UTC, more than 60 s from this machine's clock "
        "(2026-12-01 20:00:00 UTC)"
    )
    once = request(token, ["true"])
    assert sessions.attach(KEY, once, NOW).exit_code == 0
    assert refused(once) == "token refused: this request was run already (each is run once)"
    elsewhere = TaskRef(namespace="default", job="shell", task_id="w-0", attempt=1)
    with pytest.raises(SessionRefused) as raised:
        sessions.attach(elsewhere, request(token, ["true"], key=elsewhere), NOW)
    assert str(raised.value) == (
        "worker w-0 (attempt 1) on m0 hosts no interactive sessions (its group does not ask "
        "capabilities.interactive_token, or this attempt was not set up here)"
    )


def test_a_token_that_was_altered_is_no_token() -> None:
    token = session_token.new_token()
    with pytest.raises(session_token.BadToken) as raised:
        session_token.public_key(token[:-5])
    assert str(raised.value) == "not an interactive token (it is cut short or altered)"


def test_a_machine_that_hosts_no_sessions_fails_the_attempt_at_set_up(tmp_path: Path) -> None:
    sessions = Sessions(ProcessRuntime(tmp_path / "attempts"), tmp_path / "agent", "m0", hosts=False)
    with pytest.raises(RuntimeFailure) as raised:
        sessions.set_up(KEY)
    assert raised.value.reason.text == f"Interactive token: {NO_SESSIONS}"
    assert raised.value.reason.text == (
        "Interactive token: this machine hosts no interactive sessions (its agent was started with "
        "--no-interactive-sessions)"
    )
