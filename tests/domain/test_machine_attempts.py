"""The machine's record of its attempts (`workflows/domain/machine/attempts.py`): each attempt's phase and holds
through its life, and the admission of GPUs and ports as tables, the race "a start ends during the look" among
them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from workflows.domain.group_parts import ExternalAccess
from workflows.domain.inventory import GpuInfo, PortRange
from workflows.domain.machine.attempts import (
    Admitted,
    Attempts,
    Phase,
    PortMapping,
    Refused,
    admit_gpus,
    assign_ports,
)
from workflows.domain.refs import TaskRef

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def ref(task: str = "w-0", attempt: int = 0) -> TaskRef:
    return TaskRef(namespace="team-a", job="llm", task_id=task, attempt=attempt)


def slug(task: str, attempt: int = 0) -> str:
    return ref(task, attempt).slug


def gpu(index: int, fault: str | None = None, at_risk: str | None = None) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index}", model="L4", memory_bytes=24 << 30, fault=fault, at_risk=at_risk)


FOUR = [gpu(0), gpu(1), gpu(2), gpu(3)]

# ---- GPUs ------------------------------------------------------------------------------------------------------

GPU_CASES = [
    # (id, count, gpus, running, held before the look, held after it, expected)
    ("a new attempt gets the lowest free GPUs", 2, FOUR, {}, {}, {}, Admitted([0, 1], started=False)),
    ("GPUs a running attempt holds are taken", 2, FOUR, {slug("a"): [0, 1]}, {}, {}, Admitted([2, 3], False)),
    ("GPUs held for an attempt being set up are taken", 1, FOUR, {}, {slug("a"): (0,)}, {slug("a"): (0,)},
     Admitted([1], False)),
    # The race (a burst of 1,000 gave one GPU to two workers): attempt a's start ended while the runtime was asked,
    # so the look did not see it running and the record no longer holds its GPU; it was held before the look.
    ("a start that ended during the look keeps its GPU", 1, FOUR, {}, {slug("a"): (0,)}, {}, Admitted([1], False)),
    ("an attempt held after the look only is counted too", 1, FOUR, {}, {}, {slug("a"): (0,)}, Admitted([1], False)),
    ("a repeated start of a running attempt finds its GPUs", 1, FOUR, {slug("w-0"): [3]}, {}, {},
     Admitted([3], started=True)),
    ("a repeated setup finds the GPUs held for it", 1, FOUR, {}, {slug("w-0"): (2,)}, {slug("w-0"): (2,)},
     Admitted([2], False)),
    ("an attempt with no GPUs held for it is admitted with none again", 0, FOUR, {}, {}, {slug("w-0"): ()},
     Admitted([], False)),
    ("a faulted GPU is never given", 2, [gpu(0, fault="Xid 79"), gpu(1), gpu(2)], {}, {}, {}, Admitted([1, 2], False)),
    ("healthy GPUs go before those at risk", 1, [gpu(0, at_risk="retired pages pending"), gpu(1)], {}, {}, {},
     Admitted([1], False)),
    ("at-risk GPUs are given when no healthy one is left", 2, [gpu(0, at_risk="x"), gpu(1)], {}, {}, {},
     Admitted([0, 1], False)),
    ("more than the free GPUs is refused, counting the free", 3, FOUR, {slug("a"): [0, 1]}, {}, {},
     Refused("needs 3 GPUs, 2 free on this machine")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("count", "gpus", "running", "before", "after", "expected"),
    [case[1:] for case in GPU_CASES],
    ids=[case[0] for case in GPU_CASES],
)
def test_gpu_admission(count, gpus, running, before, after, expected) -> None:  # type: ignore[no-untyped-def]
    assert admit_gpus(ref(), count, gpus, running, before, after) == expected


# ---- ports -----------------------------------------------------------------------------------------------------

WEB = [ExternalAccess(name="web", port=8080)]
TWO = [ExternalAccess(name="web", port=8080), ExternalAccess(name="metrics", port=9090)]
RANGE = PortRange(first=30000, last=30003)


def mapped(*pairs: tuple[ExternalAccess, int]) -> list[PortMapping]:
    return [PortMapping(a.name, a.port, p) for a, p in pairs]


PORT_CASES = [
    # (id, access, range, running, held before, held after, bindable, expected)
    ("the first ports of the range", TWO, RANGE, {}, {}, {}, set(), mapped((TWO[0], 30000), (TWO[1], 30001))),
    ("a running attempt's ports are taken", WEB, RANGE, {slug("a"): {"web": 30000}}, {}, {}, set(),
     mapped((WEB[0], 30001))),
    ("a start that ended during the look keeps its port", WEB, RANGE, {},
     {slug("a"): (PortMapping("web", 80, 30000),)}, {}, set(), mapped((WEB[0], 30001))),
    ("a port another program holds is passed over", WEB, RANGE, {}, {}, {}, {30000}, mapped((WEB[0], 30001))),
    ("not enough free ports: it waits", TWO, PortRange(first=30000, last=30001), {slug("a"): {"x": 30000}}, {}, {},
     set(), None),
    ("no range on the machine is refused", WEB, None, {}, {}, {}, set(),
     Refused("external_access needs ports, and this machine's agent has no --external-ports range")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("access", "port_range", "running", "before", "after", "busy", "expected"),
    [case[1:] for case in PORT_CASES],
    ids=[case[0] for case in PORT_CASES],
)
def test_port_assignment(access, port_range, running, before, after, busy, expected) -> None:  # type: ignore[no-untyped-def]
    assert assign_ports(access, port_range, running, before, after, lambda port: port not in busy) == expected


def test_only_the_lowest_candidates_are_asked_whether_they_are_free() -> None:
    asked: list[int] = []

    def bindable(port: int) -> bool:
        asked.append(port)
        return True

    assign_ports(WEB, PortRange(first=30000, last=39999), {}, {}, {}, bindable)
    assert asked == [30000]


# ---- an attempt's life in the record ---------------------------------------------------------------------------


def test_an_attempt_holds_its_gpus_and_ports_from_admission_until_its_start_ends() -> None:
    attempts, r = Attempts(), ref()
    attempts.picked_up(r, T0)
    assert attempts.get(r).phase is Phase.PICKED_UP  # type: ignore[union-attr]
    assert attempts.gpus_held() == {}
    attempts.admitted(r, [1])
    attempts.ports_assigned(r, [PortMapping("web", 80, 30000)])
    attempts.pulled(r)
    attempts.handed_to_runtime(r)
    assert (attempts.gpus_held(), attempts.ports_held()) == ({r.slug: (1,)}, {r.slug: (PortMapping("web", 80, 30000),)})
    attempts.let_go(r)  # a setup that ends while the runtime starts it: the start keeps its holds
    assert attempts.gpus_held() == {r.slug: (1,)}
    attempts.start_ended(r, started=True)
    assert (attempts.get(r).phase, attempts.gpus_held(), attempts.ports_held()) == (Phase.RUNNING, {}, {})  # type: ignore[union-attr]


@pytest.mark.parametrize("phase", ["setting up", "ready"], ids=["while set up", "at the barrier"])
def test_an_attempt_let_go_before_its_start_gives_back_what_it_held(phase: str) -> None:
    attempts, r = Attempts(), ref()
    attempts.admitted(r, [0, 1])
    if phase == "ready":
        attempts.pulled(r)
        assert attempts.get(r).pulled  # type: ignore[union-attr]
    attempts.let_go(r)
    assert (attempts.get(r).phase, attempts.gpus_held()) == (Phase.LET_GO, {})  # type: ignore[union-attr]


def test_a_start_the_runtime_refused_holds_nothing() -> None:
    attempts, r = Attempts(), ref()
    attempts.admitted(r, [0])
    attempts.handed_to_runtime(r)
    attempts.start_ended(r, started=False)
    assert (attempts.get(r).phase, attempts.gpus_held()) == (Phase.LET_GO, {})  # type: ignore[union-attr]


def test_the_activities_that_start_or_watch_an_attempt_are_counted() -> None:
    attempts, r = Attempts(), ref()
    attempts.activity_began(r)
    attempts.activity_began(r)
    attempts.activity_ended(r)
    assert attempts.watched(r)
    attempts.activity_ended(r)
    assert not attempts.watched(r)
    assert not attempts.watched(ref("other"))


def test_a_watch_that_begins_makes_the_attempt_ours_and_watched_again() -> None:
    attempts, r = Attempts(), ref()
    attempts.unwatched(r)
    attempts.watch_began(r)
    assert (attempts.ours_all(), attempts.unwatched_all(), attempts.get(r).phase) == ([r], [], Phase.RUNNING)  # type: ignore[union-attr]


def test_returned_exits_are_kept_for_a_while_and_told_again_after_the_lease_is_taken_again() -> None:
    attempts, old, recent = Attempts(), ref("w-0"), ref("w-1")
    attempts.returned(old, at=100.0, keep_seconds=600.0)
    attempts.returned(recent, at=650.0, keep_seconds=600.0)
    attempts.registered_again(now=720.0, keep_seconds=600.0)  # old returned 620 s ago: forgotten
    assert attempts.unwatched_all() == [recent]
    assert [a.returned_at for a in attempts] == [None, None]


def test_an_attempt_returned_longer_ago_than_the_keep_is_forgotten_unless_something_still_has_it() -> None:
    attempts = Attempts()
    attempts.returned(ref("w-0"), at=0.0, keep_seconds=600.0)
    attempts.returned(ref("w-1"), at=0.0, keep_seconds=600.0)
    attempts.activity_began(ref("w-1"))  # watched again (a repeated supervise)
    attempts.returned(ref("w-2"), at=600.0, keep_seconds=600.0)
    assert [(a.ref.task_id, a.returned_at) for a in attempts] == [("w-1", None), ("w-2", 600.0)]


def test_a_stop_is_remembered_and_a_forgotten_attempt_leaves_nothing() -> None:
    attempts, r = Attempts(), ref()
    attempts.stop_asked(r)
    assert attempts.stopping(r)
    attempts.forget(r)
    assert (attempts.get(r), list(attempts)) == (None, [])


def test_attempts_are_listed_by_slug() -> None:
    attempts = Attempts()
    for task in ("w-2", "w-0", "w-1"):
        attempts.ours(ref(task))
    assert [r.task_id for r in attempts.ours_all()] == ["w-0", "w-1", "w-2"]


def test_a_held_record_is_said_once_per_attempt() -> None:
    attempts = Attempts()
    assert [attempts.held_first_seen(ref()) for _ in range(3)] == [True, False, False]
    assert attempts.held_first_seen(ref("w-1"))
    attempts.watch_began(ref())  # a watch that re-attaches does not say it again
    assert not attempts.held_first_seen(ref())
