"""The console: a web page, served by the HTTP API at `/console/`, that shows every run and says why it waits.

Static files only (`static/`: HTML, JavaScript, CSS; no build step, nothing fetched from elsewhere): the page calls
the API's own JSON routes with the bearer token a person pastes into its login box, or that a one-time sign-in link
of `astraeus dev` hands it. What the API adds for it is the advice for each waiting reason (`advice.py`), served as
JSON, so that the words live in Python beside the reasons, and where the Temporal UI is, for its links.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from workers.console.advice import table

STATIC = Path(__file__).parent / "static"
USED_LINK = (
    "This sign-in link was used already (each works once), or the astraeus dev that printed it stopped: paste a "
    "token instead (the admin token astraeus dev printed, or astraeus token create)"
)


class SignIn:
    """One-time sign-in links: `astraeus dev` prints the console's address with a code in its fragment (never sent
    to a server, nor kept in its logs); the page trades the code, once, for the token it stands for and takes the
    code out of its address. A copy of the link found later (in a browser's history, a terminal's scrollback) signs
    nobody in. Codes live in this process only: they end with it."""

    def __init__(self) -> None:
        self._codes: dict[str, str] = {}

    def link(self, secret: str) -> str:
        """A new code for `secret`, good for one sign-in."""
        code = secrets.token_urlsafe(24)
        self._codes[code] = secret
        return code

    def redeem(self, code: str) -> str | None:
        """The token `code` stands for, the first time it is given; None after, or for a code never made."""
        return self._codes.pop(code, None)


class SignInBody(BaseModel):
    code: str = Field(max_length=256)


def mount(
    app: FastAPI, *, sign_in: SignIn | None = None, temporal_ui: str | None = None, temporal_namespace: str = "default"
) -> None:
    """Serve the console on `app`: the page at /console/, its advice at /console/advice.json and where the Temporal
    UI is at /console/config.json (no token: they say nothing of any run), and POST /console/sign-in, which trades a
    one-time code for its token."""
    config = {"temporal_ui": temporal_ui, "temporal_namespace": temporal_namespace}

    @app.get("/console", include_in_schema=False)
    async def console_root() -> RedirectResponse:
        return RedirectResponse("/console/")

    @app.get("/console/advice.json", include_in_schema=False)
    async def advice() -> JSONResponse:
        return JSONResponse(table(), headers={"cache-control": "no-cache"})

    @app.get("/console/config.json", include_in_schema=False)
    async def console_config() -> JSONResponse:
        return JSONResponse(config, headers={"cache-control": "no-cache"})

    @app.post("/console/sign-in", include_in_schema=False)
    async def redeem(body: SignInBody) -> JSONResponse:
        secret = sign_in.redeem(body.code) if sign_in is not None else None
        if secret is None:
            return JSONResponse({"error": USED_LINK}, status_code=401)
        return JSONResponse({"token": secret}, headers={"cache-control": "no-store"})

    app.mount("/console", StaticFiles(directory=STATIC, html=True), name="console")
