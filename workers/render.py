"""How the CLI shows runs, workers and machines to people: times in the viewer's zone (or UTC), marked with it;
sizes in binary units."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from workers.console.advice import FAILURES
from workers.listing import RunSummary
from workflows.domain.inventory import NodeView
from workflows.domain.run.status import Status, StatusEntry
from workflows.domain.run.views import Event, JobDescription


def _t(at: datetime | None, utc: bool) -> str:
    """A time of day, as in a history: `15:34:53.091 CET`."""
    if at is None:
        return "-"
    local = at.astimezone(UTC if utc else None)
    return f"{local.strftime('%H:%M:%S.%f')[:-3]} {local.tzname()}"


def _when(at: datetime, utc: bool) -> str:
    """A date and time: `2026-12-01 15:34:53 CET`."""
    local = at.astimezone(UTC if utc else None)
    return f"{local.strftime('%Y-%m-%d %H:%M:%S')} {local.tzname()}"


def age(seconds: float) -> str:
    """How long ago, to the unit that matters: 45s, 12m, 5h, 3d."""
    for unit, size, below in (("s", 1, 120), ("m", 60, 120 * 60), ("h", 3600, 48 * 3600)):
        if seconds < below:
            return f"{max(0, int(seconds // size))}{unit}"
    return f"{int(seconds // 86400)}d"


def size(n: float) -> str:
    """Bytes in binary units: 512 MiB, 15.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f}".removesuffix(".0") + f" {unit}"
        n /= 1024
    return f"{n:.1f}".removesuffix(".0") + " PiB"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def render_status(status: Status) -> str:
    return f"{status.state}: {status.reason}"


def render_runs(runs: Sequence[RunSummary], now: datetime) -> str:
    if not runs:
        return "no runs"
    rows: list[tuple[str, ...]] = [("NAMESPACE", "NAME", "STATE", "AGE", "WORKERS", "GPUS")]
    for r in runs:
        counts = ("-" if n is None else str(n) for n in (r.workers, r.gpus))
        rows.append((r.namespace, r.name, r.state, age((now - r.created_at).total_seconds()), *counts))
    return _table(rows)


def render_describe(d: JobDescription, utc: bool = False) -> str:
    lines = [
        f"Run:       {d.namespace}/{d.name}",
        f"State:     {d.status.state}",
        f"Reason:    {d.status.reason}",
        f"Created:   {_when(d.status.created_at, utc)}",
        "",
    ]
    rows = [("WORKER", "STATE", "MACHINE", "RESTARTS", "REASON")]
    for t in d.tasks:
        state = "Restarting" if t.restart_at else t.status.state
        reason = f"{t.status.reason} (restarts at {_when(t.restart_at, utc)})" if t.restart_at else t.status.reason
        if t.healthy is not None:
            reason += " (healthy)" if t.healthy else " (not healthy)"
        rows.append((t.id, state, t.node or "-", str(t.restarts), reason))
    lines.append(_table(rows))
    for t in d.tasks:
        if t.node_address:
            lines += ["", f"Node address of {t.id}: {t.node_address}"]
    for t in d.tasks:
        if t.external:
            lines += ["", f"External access of {t.id}: " + ", ".join(f"{n} {a}" for n, a in t.external.items())]
    for t in d.tasks:
        if t.last_failure:
            lines += ["", f"Last failure of {t.id}: {t.last_failure.reason}"]
            help = FAILURES.get(t.last_failure.reason)
            lines += [f"  {help.advice}"] if help else []
            lines += [f"  | {line}" for line in t.last_failure.log_tail.splitlines()]
    if d.placement.nodes:
        lines += ["", "Why it waits, machine by machine:"]
        lines += [f"  {n.name}: {'; '.join(n.reasons) or 'fits'}" for n in d.placement.nodes]
    return "\n".join(lines)


def _entries(entries: Sequence[StatusEntry], utc: bool) -> list[str]:
    return [f"  {_t(e.at, utc)}  {e.state:<12} {e.reason}" for e in entries]


def render_history(d: JobDescription, utc: bool = False) -> str:
    lines = [f"run {d.namespace}/{d.name}", *_entries(d.history, utc)]
    for t in d.tasks:
        lines += [f"worker {t.id}", *_entries(t.history, utc)]
    return "\n".join(lines)


def render_events(events: Sequence[Event], utc: bool = False) -> str:
    return "\n".join(f"{_t(e.at, utc)}  {e.object:<12} {e.state:<12} {e.reason}" for e in events)


def _conditions(v: NodeView) -> str:
    """What keeps work off the machine, or puts it at risk: a cordon, pressure, GPU faults."""
    inv = v.inventory
    notes = [f"cordoned: {v.cordon}" if v.cordon else "cordoned"] if v.cordon is not None else []
    if inv:
        notes += [f"{c} pressure" for c in inv.pressure]
        notes += [f"GPU {g.index}: {g.fault}" for g in inv.gpus if g.fault is not None]
        notes += [f"GPU {g.index} at risk: {g.at_risk}" for g in inv.gpus if g.fault is None and g.at_risk]
        notes += [f"refuses runs: {inv.refuses_runs}"] if inv.refuses_runs else []
    return "; ".join(notes) or "-"


def render_nodes(views: Sequence[NodeView]) -> str:
    if not views:
        return "no machines are registered"
    rows = [("MACHINE", "STATE", "CPUS", "MEMORY", "GPUS", "CONDITIONS")]
    for v in views:
        inv = v.inventory
        gpus = ", ".join(sorted({g.model for g in inv.gpus})) if inv and inv.gpus else ""
        faulted = sum(g.fault is not None for g in inv.gpus) if inv else 0
        at_risk = sum(g.fault is None and g.at_risk is not None for g in inv.gpus) if inv else 0
        health = ", ".join(f"{n} {what}" for n, what in ((faulted, "faulted"), (at_risk, "at risk")) if n)
        gpus += f" ({health})" if health else ""
        state = v.state.value + (",Cordoned" if v.cordon is not None else "")
        state += ",Pressure" if inv and inv.pressure else ""
        rows.append((
            v.name,
            state,
            f"{inv.cpus:g}" if inv else "-",
            size(inv.memory_bytes) if inv else "-",
            f"{len(inv.gpus)} {gpus}".strip() if inv else "-",
            _conditions(v),
        ))  # fmt: skip
    return _table(rows)
