"""The cluster's catalogue of drives, pure: what `astraeus drive create` asks for, and how a machine finds the data
to copy. A drive is a named set of files held on one machine (of a site, when it names one); a worker that mounts
it runs on that machine, or on another (of its site) that copies it to its data location first and keeps the copy."""

from __future__ import annotations

import posixpath
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from workflows.domain.bounds import MAX_BYTES, PathText
from workflows.domain.constraints import Drive
from workflows.domain.group_parts import Name

SOURCE_NEEDS = (
    "a directory the machines of its site can read: an absolute path or a file:// URL (copying over a network "
    "needs a transfer service, which Astraeus does not have)"
)


def source_path(source: str) -> str:
    """The directory a machine copies a drive from: `/srv/x` or `file:///srv/x`; anything else is refused."""
    path = source
    if "://" in source:
        url = urlsplit(source)
        if url.scheme != "file" or url.netloc not in ("", "localhost"):
            raise ValueError(f"source {source}: expected {SOURCE_NEEDS}")
        path = unquote(url.path)
    if not path.startswith("/") or posixpath.normpath(path) != path or path == "/":
        raise ValueError(f"source {source}: expected {SOURCE_NEEDS}")
    return path


class NewDrive(BaseModel):
    """A drive to add to the catalogue (`astraeus drive create`, `POST /drives`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Name
    site: str | None = Field(
        None, min_length=1, max_length=63, description="The site whose machines may copy it; none: any machine."
    )
    machine: str = Field(min_length=1, max_length=253, description="The machine that holds its data.")
    size_bytes: int = Field(ge=0, le=MAX_BYTES, description="Room a copy needs at a machine's data location.")
    source: PathText = Field(description="Its files: a directory (path or file:// URL) its site's machines read.")

    @field_validator("source")
    @classmethod
    def _readable_source(cls, source: str) -> str:
        source_path(source)
        return source

    def drive(self) -> Drive:
        return Drive(name=self.name, size_bytes=self.size_bytes, node=self.machine, site=self.site, source=self.source)


class DriveReport(BaseModel):
    """A machine tried to fill its copy of a drive: `problem` says why it could not (None: it could)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    drive: str
    node: str
    problem: str | None = None


def reported(drive: Drive, report: DriveReport) -> Drive:
    """The drive after a machine's report: a failed fill is its problem ("drive <d>: <why>") until a fill works."""
    if report.problem is None:
        return drive.model_copy(update={"problem": None})
    return drive.model_copy(update={"problem": f"{report.problem} (on {report.node})"})


def in_use_refusal(name: str, runs: list[str]) -> str:
    """Why a drive in use stays: the runs whose workers mount it."""
    shown = ", ".join(runs[:5]) + (f" and {len(runs) - 5} more" if len(runs) > 5 else "")
    return f"drive {name} is in use by {shown}: stop or delete them first"
