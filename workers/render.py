"""How the CLI shows runs, workers and machines to people."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from workers.client import RunSummary
from workflows.domain.nodes import NodeView
from workflows.domain.status import StatusEntry
from workflows.domain.views import Event, JobDescription


def _t(at: datetime | None) -> str:
    return at.strftime("%H:%M:%S.%f")[:-3] if at else "-"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def render_runs(runs: Sequence[RunSummary]) -> str:
    if not runs:
        return "no runs"
    return _table([("NAMESPACE", "NAME", "STATE", "REASON")] + [(r.namespace, r.name, r.state, r.reason) for r in runs])


def render_describe(d: JobDescription) -> str:
    lines = [
        f"Run:       {d.namespace}/{d.name}",
        f"State:     {d.status.state}",
        f"Reason:    {d.status.reason}",
        f"Created:   {d.status.created_at.isoformat()}",
        "",
    ]
    rows = [("WORKER", "STATE", "MACHINE", "RESTARTS", "REASON")]
    for t in d.tasks:
        state = "Restarting" if t.restart_at else t.status.state
        reason = f"{t.status.reason} (restarts at {t.restart_at.isoformat()})" if t.restart_at else t.status.reason
        if t.healthy is not None:
            reason += " (healthy)" if t.healthy else " (not healthy)"
        rows.append((t.id, state, t.node or "-", str(t.restarts), reason))
    lines.append(_table(rows))
    for t in d.tasks:
        if t.last_failure:
            lines += ["", f"Last failure of {t.id}: {t.last_failure.reason}"]
            lines += [f"  | {line}" for line in t.last_failure.log_tail.splitlines()]
    if d.placement.nodes:
        lines += ["", "Why it waits, machine by machine:"]
        lines += [f"  {n.name}: {'; '.join(n.reasons) or 'fits'}" for n in d.placement.nodes]
    return "\n".join(lines)


def _entries(entries: Sequence[StatusEntry]) -> list[str]:
    return [f"  {_t(e.at)}  {e.state:<12} {e.reason}" for e in entries]


def render_history(d: JobDescription) -> str:
    lines = [f"run {d.namespace}/{d.name}", *_entries(d.history)]
    for t in d.tasks:
        lines += [f"worker {t.id}", *_entries(t.history)]
    return "\n".join(lines)


def render_events(events: Sequence[Event]) -> str:
    return "\n".join(f"{_t(e.at)}  {e.object:<12} {e.state:<12} {e.reason}" for e in events)


def render_nodes(views: Sequence[NodeView]) -> str:
    if not views:
        return "no machines are registered"
    rows = [("MACHINE", "STATE", "CPUS", "MEMORY", "GPUS")]
    for v in views:
        inv = v.inventory
        gpus = ", ".join(sorted({g.model for g in inv.gpus})) if inv and inv.gpus else ""
        faulted = sum(g.fault is not None for g in inv.gpus) if inv else 0
        at_risk = sum(g.fault is None and g.at_risk is not None for g in inv.gpus) if inv else 0
        health = ", ".join(f"{n} {what}" for n, what in ((faulted, "faulted"), (at_risk, "at risk")) if n)
        gpus += f" ({health})" if health else ""
        rows.append((
            v.name,
            v.state.value,
            f"{inv.cpus:g}" if inv else "-",
            f"{inv.memory_bytes / 2**30:.1f} GiB" if inv else "-",
            f"{len(inv.gpus)} {gpus}".strip() if inv else "-",
        ))  # fmt: skip
    return _table(rows)
