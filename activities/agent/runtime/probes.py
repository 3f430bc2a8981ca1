"""What both runtimes share of a readiness check: the HTTP GET (from the machine to the worker's address) and the
short details a check reports ("HTTP 503", "connection refused", "timed out after 2s", "exited with code 1")."""

from __future__ import annotations

import http.client

from workflows.domain.group_parts import HttpGet


def timed_out(timeout_seconds: float) -> str:
    return f"timed out after {timeout_seconds:g}s"


def exited(code: int) -> str:
    return f"exited with code {code}"


def http_get(host: str, check: HttpGet, timeout_seconds: float) -> tuple[bool, str]:
    """GET http://<host>:<port><path>: a 2xx or 3xx answer passes (a redirect is not followed)."""
    connection = http.client.HTTPConnection(host, check.port, timeout=timeout_seconds)
    try:
        connection.request("GET", check.path, headers={"User-Agent": "astraeus-readiness", "Connection": "close"})
        status = connection.getresponse().status
    except TimeoutError:
        return False, timed_out(timeout_seconds)
    except http.client.RemoteDisconnected:
        return False, "connection closed without an answer"
    except ConnectionRefusedError:
        return False, "connection refused"
    except ConnectionResetError:
        return False, "connection reset"
    except http.client.HTTPException as err:
        return False, f"not an HTTP answer ({type(err).__name__})"
    except OSError as err:
        return False, (err.strerror or str(err)).lower()
    finally:
        connection.close()
    return 200 <= status < 400, f"HTTP {status}"
