"""The console: a web page, served by the HTTP API at `/console/`, that shows every run and says why it waits.

Static files only (`static/`: HTML, JavaScript, CSS; no build step, nothing fetched from elsewhere): the page calls
the API's own JSON routes with the bearer token a person pastes into its login box. What the API adds for it is the
advice for each waiting reason (`advice.py`), served as JSON, so that the words live in Python beside the reasons.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from workers.console.advice import table

STATIC = Path(__file__).parent / "static"


def mount(app: FastAPI) -> None:
    """Serve the console on `app`: the page at /console/, its advice at /console/advice.json (no token: it is the
    same for everyone, and says nothing of any run)."""

    @app.get("/console", include_in_schema=False)
    async def console_root() -> RedirectResponse:
        return RedirectResponse("/console/")

    @app.get("/console/advice.json", include_in_schema=False)
    async def advice() -> JSONResponse:
        return JSONResponse(table(), headers={"cache-control": "no-cache"})

    app.mount("/console", StaticFiles(directory=STATIC, html=True), name="console")
