"""Gang runs in a pass: placed whole or not at all, min_available, quota asked for the gang, and a gang that waits
leading the queue so that smaller runs behind it cannot starve it. Whole sentences, as the spec writes them."""

from __future__ import annotations

from tests.domain.builders import at, holding, ib, machine, request
from workflows.domain.constraints import Network
from workflows.domain.inventory import NodeState, NodeView
from workflows.domain.reasons import NodeReasons, Reason
from workflows.domain.requests import Allocation, TaskRequest
from workflows.domain.scheduling.queue import Plan, Preemption, schedule
from workflows.domain.scheduling.quotas import Quota


def run(
    requests: list[TaskRequest], nodes: list[NodeView], allocations: list[Allocation] | None = None, **kwargs: object
) -> Plan:
    return schedule(requests, nodes, allocations or [], at(0), **kwargs)  # type: ignore[arg-type]


def outcome(plan: Plan) -> dict[str, str | None]:
    """Each worker (`run/task`): its machine, or the reason it waits."""
    return {
        f"{d.request.run}/{d.request.task_id}": d.node or (d.reason.text if d.reason else None) for d in plan.decisions
    }


def gang(k: int, *, run: str = "g", gpus: int = 8, **fields: object) -> list[TaskRequest]:
    return [request(f"w-{i}", run=run, gpus=gpus, gang=True, **fields) for i in range(k)]


EIGHTS = [machine("n0", gpus=8), machine("n1", gpus=8)]


# ---- whole or nothing -------------------------------------------------------------------------------------------


def test_a_gang_that_fits_is_placed_whole_tightest_first() -> None:
    assert outcome(run(gang(3, gpus=4), EIGHTS)) == {"g/w-0": "n0", "g/w-1": "n0", "g/w-2": "n1"}


def test_when_one_member_does_not_fit_none_is_placed_and_every_member_says_why() -> None:
    nodes = [*EIGHTS, machine("n2", gpus=8, state=NodeState.DOWN)]
    plan = run(gang(3), nodes)
    assert outcome(plan) == {f"g/w-{i}": "Gang cannot be placed whole: 2 of 3 machines ready" for i in range(3)}
    # The machines' reasons for the first member that did not fit, seen with the earlier members in place.
    expected = [
        NodeReasons(name="n0", reasons=[Reason("InsufficientGpus", "insufficient gpus: need 8, 0 free and usable")]),
        NodeReasons(name="n1", reasons=[Reason("InsufficientGpus", "insufficient gpus: need 8, 0 free and usable")]),
        NodeReasons(name="n2", reasons=[Reason("NodeNotReady", "machine is not ready (Down)")]),
    ]
    assert [d.nodes for d in plan.decisions] == [expected] * 3
    assert {d.reason.code for d in plan.decisions if d.reason} == {"GangCannotBePlaced"}


def test_a_gang_that_never_fits_whole_does_not_hold_room_from_others() -> None:
    plan = run([*gang(3), request(run="small", submitted=1, gpus=8)], EIGHTS)
    assert outcome(plan) == {
        "g/w-0": "Gang cannot be placed whole: 2 of 2 machines ready",
        "g/w-1": "Gang cannot be placed whole: 2 of 2 machines ready",
        "g/w-2": "Gang cannot be placed whole: 2 of 2 machines ready",
        "small/w-0": "n0",
    }
    assert plan.holds == {}


def test_topology_checks_see_the_earlier_members_tentative_places() -> None:
    one_each = {"one_per_machine": True}
    nodes = [machine("n0", gpus=16), machine("n1", gpus=8)]
    assert outcome(run(gang(2, topology=one_each), nodes)) == {"g/w-0": "n1", "g/w-1": "n0"}
    plan = run(gang(2, topology=one_each), nodes[:1])
    assert outcome(plan) == {f"g/w-{i}": "Gang cannot be placed whole: 1 of 1 machines ready" for i in range(2)}
    assert plan.decisions[0].nodes == [
        NodeReasons(
            name="n0",
            reasons=[Reason("AnotherWorkerOnMachine", "another worker of this run is already on the machine")],
        )
    ]


# ---- the head of the queue --------------------------------------------------------------------------------------

# n0 is busy until 13:00 (a time limit); n1 is free. A gang of two whole machines waits for n0 to empty.
HEAD_HELD = [holding("n0", gpus=4, limit=3600)]


def test_a_gang_that_would_fit_once_work_ends_holds_a_machine_for_every_member() -> None:
    plan = run(gang(2), EIGHTS, HEAD_HELD)
    assert outcome(plan) == {
        "g/w-0": "Gang cannot be placed whole: 2 of 2 machines ready",
        "g/w-1": "Gang cannot be placed whole: 2 of 2 machines ready",
    }
    # All members start together, when the last of them can.
    assert plan.holds == {("job/default/g", "w-0"): ("n1", at(60)), ("job/default/g", "w-1"): ("n0", at(60))}


def test_the_gang_head_is_not_starved_by_smaller_later_runs() -> None:
    later = [request(run="small", submitted=1, gpus=1), request(run="tiny", submitted=2, gpus=2, priority=0)]
    plan = run([*gang(2), *later], EIGHTS, HEAD_HELD)
    assert outcome(plan) == {
        "g/w-0": "Gang cannot be placed whole: 2 of 2 machines ready",
        "g/w-1": "Gang cannot be placed whole: 2 of 2 machines ready",
        "small/w-0": "Queued behind g, which starts by 2025-01-01 13:00 UTC",
        "tiny/w-0": "Queued behind g, which starts by 2025-01-01 13:00 UTC",
    }


def test_work_that_ends_before_the_gang_starts_may_backfill() -> None:
    plan = run([*gang(2), request(run="short", submitted=1, gpus=4, limit=1800)], EIGHTS, HEAD_HELD)
    assert outcome(plan)["short/w-0"] == "n0"


def test_a_gang_behind_another_head_queues_behind_it() -> None:
    plan = run([*gang(2), *gang(2, run="h", submitted=1)], EIGHTS, HEAD_HELD)
    assert outcome(plan)["h/w-0"] == "Queued behind g, which starts by 2025-01-01 13:00 UTC"
    assert outcome(plan)["h/w-1"] == "Queued behind g, which starts by 2025-01-01 13:00 UTC"


def test_a_lower_priority_gang_cannot_take_the_heads_machine() -> None:
    # It would fit in n0's free half now, but would still run when the head starts there.
    head = request(run="big", priority=5, gpus=8)
    plan = run(
        [head, *gang(1, gpus=4, priority=1, submitted=1)], EIGHTS[:1], [holding("n0", gpus=4, limit=3600, priority=9)]
    )
    assert outcome(plan) == {
        "big/w-0": "Next to run (priority 5): starts by 2025-01-01 13:00 UTC as running work ends",
        "g/w-0": "Queued behind higher-priority work (big)",
    }


# ---- min_available ----------------------------------------------------------------------------------------------


def test_min_available_places_the_minimum_and_the_rest_wait_on_their_own() -> None:
    nodes = [*EIGHTS, machine("n2", gpus=8)]
    plan = run(gang(4, min_available=2), nodes, [holding("n2", gpus=4)])
    assert outcome(plan) == {
        "g/w-0": "n0",
        "g/w-1": "n1",
        "g/w-2": "Next to run (priority 0): waits for running work to end",
        "g/w-3": "Next to run (priority 0): waits for running work to end",
    }


def test_min_available_not_met_places_none() -> None:
    plan = run(gang(3, min_available=2), EIGHTS, [holding("n1", gpus=4)])
    assert outcome(plan) == {
        f"g/w-{i}": "Cannot place the minimum to start together: 1 of 2 fit at once; 2 of 2 machines ready"
        for i in range(3)
    }
    assert plan.decisions[0].reason == Reason(
        "CannotPlaceMinimum", "Cannot place the minimum to start together: 1 of 2 fit at once; 2 of 2 machines ready"
    )
    assert plan.decisions[2].nodes == [
        NodeReasons(name="n0", reasons=[Reason("InsufficientGpus", "insufficient gpus: need 8, 0 free and usable")]),
        NodeReasons(name="n1", reasons=[Reason("InsufficientGpus", "insufficient gpus: need 8, 4 free and usable")]),
    ]


def test_placed_members_count_toward_the_minimum() -> None:
    placed = [holding("n0", run="g", task="w-0", gpus=8, group="w")]
    waiting = gang(3, min_available=2)[1:]
    assert outcome(run(waiting, EIGHTS, placed)) == {
        "g/w-1": "n1",
        "g/w-2": "Next to run (priority 0): waits for running work to end",
    }
    plan = run(gang(3, min_available=3)[1:], EIGHTS, placed)
    assert set(outcome(plan).values()) == {
        "Cannot place the minimum to start together: 2 of 3 fit at once; 2 of 2 machines ready"
    }


def test_a_minimum_already_met_leaves_every_waiting_member_on_its_own() -> None:
    placed = [holding(f"n{i}", run="g", task=f"w-{i}", gpus=8, group="w") for i in range(2)]
    nodes = [*EIGHTS, machine("n2", gpus=4)]
    assert outcome(run(gang(4, gpus=16, min_available=2)[2:], nodes, placed)) == {
        "g/w-2": "No machine fits: 3 of 3 machines ready",
        "g/w-3": "No machine fits: 3 of 3 machines ready",
    }


# ---- quota ------------------------------------------------------------------------------------------------------

QUOTA = {"default": Quota(namespace="default", gpus=8)}


def test_a_gang_waits_for_its_quota_as_one_and_its_run_records_it() -> None:
    plan = run(gang(3, gpus=2), [machine("n0", gpus=16)], [holding("n1", run="mine", gpus=4)], quotas=QUOTA)
    assert {d.reason for d in plan.decisions} == {
        Reason("GangWaitsForQuota", "Gang waits for namespace quota: gpus 4 in use + 6 asked > 8")
    }
    assert {d.reached for d in plan.decisions} == {Reason("QuotaReached", "Quota reached: gpus 4 in use + 6 asked > 8")}
    assert len(plan.decisions) == 3


def test_a_gang_asks_quota_for_its_minimum_and_the_rest_ask_one_by_one() -> None:
    plan = run(gang(3, gpus=4, min_available=2), [machine("n0", gpus=16)], quotas=QUOTA)
    assert outcome(plan) == {
        "g/w-0": "n0",
        "g/w-1": "n0",
        "g/w-2": "Waits for namespace quota: gpus 8 in use + 4 asked > 8",
    }


def test_a_gang_over_the_quota_at_all_says_so() -> None:
    plan = run(gang(3, gpus=4), [machine("n0", gpus=16)], quotas={"default": Quota(namespace="default", gpus=4)})
    assert set(outcome(plan).values()) == {
        "Waits for more than the namespace's quota allows at all (gpus 12 asked > 4): raise the quota or ask for less"
    }


# ---- preemption -------------------------------------------------------------------------------------------------

LOW_ON_BOTH = [holding("n0", run="a", gpus=8, started=-600), holding("n1", run="b", gpus=8, started=-60)]
G = "job/default/g"


def test_a_higher_priority_gang_preempts_lower_priority_work_on_every_machine_it_needs() -> None:
    plan = run(gang(2, priority=10), EIGHTS, LOW_ON_BOTH)
    assert outcome(plan) == {f"g/w-{i}": "Preempting 2 lower-priority worker(s) of a, b to start" for i in range(2)}
    assert plan.preemptions == [
        Preemption("job/default/a", ("x-0",), "g", (G, "w-0")),
        Preemption("job/default/b", ("x-0",), "g", (G, "w-0")),
    ]
    assert plan.holds == {}


def test_work_behind_a_preempting_gang_does_not_take_its_room() -> None:
    later = request(run="later", priority=5, submitted=1, gpus=1)
    plan = run([*gang(2, priority=10), later], EIGHTS, LOW_ON_BOTH)
    assert outcome(plan)["later/w-0"] == "Queued behind higher-priority work (g)"


def test_while_its_victims_stop_every_member_keeps_its_room() -> None:
    preempting = {victim.key: (G, "w-0") for victim in LOW_ON_BOTH}
    later = [request(run="later", priority=20, submitted=5, gpus=8), request(run="small", submitted=6, gpus=1)]
    plan = run([*gang(2, priority=10), *later], EIGHTS, LOW_ON_BOTH, preempting=preempting)
    assert outcome(plan) == {
        "g/w-0": "Starting: waiting for 2 preempted worker(s) to stop",
        "g/w-1": "Starting: waiting for 2 preempted worker(s) to stop",
        "later/w-0": "Queued behind g",
        "small/w-0": "Queued behind higher-priority work (g)",
    }
    assert plan.preemptions == []


def test_a_gang_whose_member_no_longer_fits_keeps_no_room() -> None:
    # b is gone but n1 was cordoned meanwhile: the gang no longer fits whole once a is gone, so n0 is not kept.
    nodes = [EIGHTS[0], machine("n1", gpus=8, cordon="repairs"), machine("n2", gpus=4)]
    preempting = {victim.key: (G, "w-0") for victim in LOW_ON_BOTH}
    small = request(run="small", priority=5, submitted=1, gpus=4)
    plan = run([*gang(2, priority=10), small], nodes, LOW_ON_BOTH[:1], preempting=preempting)
    assert outcome(plan) == {
        "g/w-0": "Gang cannot be placed whole: 3 of 3 machines ready",
        "g/w-1": "Gang cannot be placed whole: 3 of 3 machines ready",
        "small/w-0": "n2",
    }
    assert plan.preemptions == []


def test_once_its_victims_are_gone_the_gang_is_placed_whole() -> None:
    preempting = {victim.key: (G, "w-0") for victim in LOW_ON_BOTH}
    assert outcome(run(gang(2, priority=10), EIGHTS, [], preempting=preempting)) == {"g/w-0": "n0", "g/w-1": "n1"}


def test_nothing_is_preempted_when_the_gang_would_still_not_fit_whole() -> None:
    held = [holding("n0", run="a", gpus=8), holding("n1", run="senior", gpus=8, priority=20)]
    plan = run(gang(2, priority=10), EIGHTS, held)
    assert plan.preemptions == []
    assert set(outcome(plan).values()) == {"Gang cannot be placed whole: 2 of 2 machines ready"}
    assert set(plan.holds) == {(G, "w-0"), (G, "w-1")}


def test_equal_or_higher_priority_work_is_never_preempted_for_a_gang() -> None:
    for priority in (10, 11):
        held = [holding("n0", run="a", gpus=8, priority=priority), holding("n1", run="b", gpus=8, priority=priority)]
        plan = run(gang(2, priority=10), EIGHTS, held)
        assert plan.preemptions == []
        assert set(outcome(plan).values()) == {"Gang cannot be placed whole: 2 of 2 machines ready"}


def test_members_take_free_machines_first_and_victims_lose_the_least_work() -> None:
    nodes = [*EIGHTS, machine("n2", gpus=8), machine("n3", gpus=8)]
    held = [
        holding("n0", run="old", gpus=8, started=-7200),
        holding("n1", run="young", task="x-1", gpus=4, started=-60),
        holding("n1", run="young", task="x-2", gpus=4, started=-120),
        holding("n2", run="mid", gpus=8, started=-600),
    ]
    plan = run(gang(3, priority=10), nodes, held)
    assert set(outcome(plan).values()) == {"Preempting 3 lower-priority worker(s) of mid, young to start"}
    assert [(p.job_id, p.task_ids) for p in plan.preemptions] == [
        ("job/default/mid", ("x-0",)),
        ("job/default/young", ("x-1", "x-2")),
    ]


def test_members_share_a_machine_that_one_victim_frees() -> None:
    plan = run(gang(2, gpus=4, priority=10), EIGHTS[:1], [holding("n0", run="a", gpus=8)])
    assert outcome(plan) == {f"g/w-{i}": "Preempting 1 lower-priority worker(s) of a to start" for i in range(2)}


def test_a_gang_preempts_only_for_its_minimum() -> None:
    nodes = [machine(f"n{i}", gpus=8) for i in range(4)]
    held = [holding(f"n{i}", run=f"low{i}", gpus=8, started=-60 * (i + 1)) for i in range(4)]
    plan = run(gang(4, priority=10, min_available=2), nodes, held)
    assert set(outcome(plan).values()) == {"Preempting 2 lower-priority worker(s) of low0, low1 to start"}
    assert len(plan.decisions) == 4
    preempting = {(f"job/default/low{i}", "x-0"): (G, "w-0") for i in range(2)}
    again = run(gang(4, priority=10, min_available=2), nodes, held, preempting=preempting)
    assert set(outcome(again).values()) == {"Starting: waiting for 2 preempted worker(s) to stop"}
    assert again.preemptions == []


def test_victims_in_another_namespace_are_not_named_and_do_not_see_who() -> None:
    held = [holding("n0", run="a", gpus=8), holding("n1", run="theirs", namespace="ns2", gpus=8)]
    plan = run(gang(2, priority=10), EIGHTS, held)
    assert set(outcome(plan).values()) == {
        "Preempting 2 lower-priority worker(s) of (a job in another namespace), a to start"
    }
    assert [(p.job_id, p.by) for p in plan.preemptions] == [
        ("job/default/a", "g"),
        ("job/ns2/theirs", "(a job in another namespace)"),
    ]


def test_beyond_its_running_minimum_a_member_preempts_and_waits_as_a_single_worker() -> None:
    placed = [holding("n0", run="g", task="w-0", gpus=8, group="w", priority=10)]
    victim = holding("n1", run="low", gpus=8)
    waiting = gang(2, priority=10, min_available=1)[1:]
    plan = run(waiting, EIGHTS, [*placed, victim])
    assert outcome(plan) == {"g/w-1": "Preempting 1 lower-priority worker(s) of low to start"}
    assert plan.preemptions == [Preemption("job/default/low", ("x-0",), "g", (G, "w-1"))]
    again = run(waiting, EIGHTS, [*placed, victim], preempting={victim.key: (G, "w-1")})
    assert outcome(again) == {"g/w-1": "Starting: waiting for 1 preempted worker(s) to stop"}


# ---- one fabric -------------------------------------------------------------------------------------------------

# Two InfiniBand fabrics of two machines each, 8 GPUs a machine.
FABRICS = [
    machine("a0", gpus=8, ports=[ib(fabric="ib-0")]),
    machine("a1", gpus=8, ports=[ib(fabric="ib-0")]),
    machine("b0", gpus=8, ports=[ib(fabric="ib-1")]),
    machine("b1", gpus=8, ports=[ib(fabric="ib-1")]),
]


def test_a_gang_asking_for_infiniband_keeps_its_members_on_one_fabric() -> None:
    # a1 is busy: ib-0 has one free machine, ib-1 two. The gang of two goes to ib-1, not across both fabrics.
    plan = run(gang(2, network=Network(infiniband_gbps=200)), FABRICS, [holding("a1", gpus=8)])
    assert outcome(plan) == {"g/w-0": "b0", "g/w-1": "b1"}


def test_a_gang_that_cannot_share_one_fabric_waits_and_says_why_for_each_machine() -> None:
    nodes = [*FABRICS[:1], *FABRICS[2:3]]  # a0 on ib-0, b0 on ib-1: room for two, but never on one fabric
    plan = run(gang(2, network=Network(infiniband_gbps=200)), nodes)
    assert outcome(plan) == {f"g/w-{i}": "Gang cannot be placed whole: 2 of 2 machines ready" for i in range(2)}
    assert [r.text for n in plan.decisions[0].nodes for r in n.reasons] == [
        "insufficient gpus: need 8, 0 free and usable",
        "no active InfiniBand port at 200 Gb/s or faster (mlx5_0 active at 400 Gb/s on fabric ib-1; its gang is on "
        "fabric ib-0)",
    ]


def test_a_gang_asking_for_a_fabric_goes_only_there() -> None:
    plan = run(gang(2, network=Network(fabric="ib-1")), FABRICS)
    assert outcome(plan) == {"g/w-0": "b0", "g/w-1": "b1"}


def test_a_patient_gang_waits_for_one_fabric_then_starts_on_ethernet() -> None:
    # One free machine on ib-0 (the other busy) and one on Ethernet: the gang waits out its patience for ib-0.
    nodes = [*FABRICS[:2], machine("eth", gpus=8)]
    patient = gang(2, topology={"patience_seconds": 600})
    waiting = run(patient, nodes, [holding("a1", gpus=8)])
    reason = "Waiting up to 10 min more for InfiniBand fabric ib-0 (could start now on Ethernet)"
    assert outcome(waiting) == {"g/w-0": reason, "g/w-1": reason}
    later = schedule(patient, nodes, [holding("a1", gpus=8)], at(10))
    assert outcome(later) == {"g/w-0": "a0", "g/w-1": "eth"}


def test_a_gang_that_could_only_span_two_fabrics_holds_no_room_as_head() -> None:
    # ib-0 and ib-1 have one machine each: the gang of two never fits on one fabric, so it holds no machine for
    # later, and a smaller run behind it takes the tightest one now (held for the gang, it would take the other).
    nodes = [FABRICS[0], FABRICS[2]]
    plan = run([*gang(2, network=Network(infiniband_gbps=200)), request(run="small", submitted=1, gpus=8)], nodes)
    assert outcome(plan) == {
        "g/w-0": "Gang cannot be placed whole: 2 of 2 machines ready",
        "g/w-1": "Gang cannot be placed whole: 2 of 2 machines ready",
        "small/w-0": "a0",
    }
