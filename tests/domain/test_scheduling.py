"""The pass: queue order, the head's reservation and start time, backfill, the reasons of those queued behind,
preemption, quotas, arrays, patience and privacy, each with the spec's whole sentences."""

from __future__ import annotations

import random

import pytest

from tests.domain.builders import at, holding, ib, machine, request, unreported
from workflows.domain.inventory import NodeState, NodeView
from workflows.domain.reasons import NodeReasons, R, Reason
from workflows.domain.requests import Allocation, TaskRequest
from workflows.domain.scheduling.machines import Cluster, Compiled
from workflows.domain.scheduling.queue import Decision, Plan, Preemption, schedule
from workflows.domain.scheduling.quotas import Quota


def run(
    requests: list[TaskRequest],
    nodes: list[NodeView],
    allocations: list[Allocation] | None = None,
    now: float = 0,
    **kwargs: object,
) -> Plan:
    return schedule(requests, nodes, allocations or [], at(now), **kwargs)  # type: ignore[arg-type]


def outcome(plan: Plan) -> dict[str, str | None]:
    """Each worker (`run/task`): its machine, or the reason it waits."""
    return {
        f"{d.request.run}/{d.request.task_id}": d.node or (d.reason.text if d.reason else None) for d in plan.decisions
    }


# ---- queue order ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requests", "placed"),
    [
        pytest.param(
            [request(run="low", priority=1, gpus=8), request(run="high", priority=5, submitted=9, gpus=8)],
            "high",
            id="higher priority first even when submitted later",
        ),
        pytest.param(
            [request(run="late", submitted=9, gpus=8), request(run="early", gpus=8)],
            "early",
            id="with equal priority the earlier claim first",
        ),
        pytest.param(
            [request("w-1", gpus=8), request("w-0", gpus=8)], "a", id="within a run the lower worker index first"
        ),
    ],
)
def test_queue_order(requests: list[TaskRequest], placed: str) -> None:
    plan = run(requests, [machine("n0", gpus=8)])
    assert [d.request.run for d in plan.decisions if d.node] == [placed]


def test_decisions_come_in_queue_order() -> None:
    requests = [request(run="c"), request(run="a", priority=9), request(run="b", priority=5)]
    assert [d.request.run for d in run(requests, [machine("n0")]).decisions] == ["a", "b", "c"]


def test_a_placement_reduces_the_room_left_for_the_next_worker() -> None:
    requests = [request("w-0", gpus=4), request("w-1", gpus=4), request("w-2", gpus=4)]
    assert outcome(run(requests, [machine("n0", gpus=8)])) == {
        "a/w-0": "n0",
        "a/w-1": "n0",
        "a/w-2": "Next to run (priority 0): waits for running work to end",
    }


# ---- what no machine can take -----------------------------------------------------------------------------------


def test_no_machine_fits_lists_every_machine_sorted_by_name() -> None:
    nodes = [
        machine("n3", cpus=64, memory=50, gpus=8),
        machine("n1", cpus=64, gpus=4),
        machine("n2", cpus=16, gpus=8),
        machine("n0", gpus=8, state=NodeState.DOWN),
    ]
    req = request(cpu=32, memory=100, gpus=8)
    assert run([req], nodes).decisions == [
        Decision(
            req,
            None,
            Reason("NoMachineFits", "No machine fits: 3 of 4 machines ready"),
            [
                NodeReasons(name="n0", reasons=[Reason("NodeNotReady", "machine is not ready (Down)")]),
                NodeReasons(
                    name="n1", reasons=[Reason("InsufficientGpus", "insufficient gpus: need 8, 4 free and usable")]
                ),
                NodeReasons(name="n2", reasons=[Reason("InsufficientCpu", "insufficient cpu: need 32 cores, 16 free")]),
                NodeReasons(
                    name="n3", reasons=[Reason("InsufficientMemory", "insufficient memory: need 100 bytes, 50 free")]
                ),
            ],
        )
    ]


def test_a_machine_that_reports_no_capacity_is_not_counted_as_ready() -> None:
    [decision] = run([request()], [unreported("n0")]).decisions
    assert decision.reason == Reason("NoMachineFits", "No machine fits: 0 of 1 machines ready")
    assert decision.nodes == [
        NodeReasons(name="n0", reasons=[Reason("NodeNoCapacity", "machine is not ready (no capacity reported)")])
    ]


def test_no_machines_registered() -> None:
    [decision] = run([request()], []).decisions
    assert decision.reason == Reason(
        "NoMachinesRegistered", "No machine fits: 0 of 0 machines ready: no machines are registered"
    )


def test_a_namespace_sees_only_the_machines_of_its_pools() -> None:
    nodes = [machine("n0", pools=["batch"]), machine("n1", pools=["batch"])]
    quotas = {"vision": Quota(namespace="vision", pools=("gpu-pool",))}
    [decision] = run([request(namespace="vision")], nodes, quotas=quotas).decisions
    assert decision.reason is not None
    assert decision.reason.text == "No machine fits: 0 of 0 machines ready: no machines are registered"
    nodes.append(machine("n2", pools=["gpu-pool"]))
    assert outcome(run([request(namespace="vision")], nodes, quotas=quotas)) == {"a/w-0": "n2"}


def test_a_drive_without_a_data_location_asks_to_choose_one() -> None:
    from workflows.domain.constraints import Drive

    drives = {"data": Drive(name="data", size_bytes=10, node="n9")}
    plan = run([request(drives=("data",))], [machine("n0"), machine("n1", state=NodeState.DOWN)], drives=drives)
    assert outcome(plan) == {"a/w-0": "Choose where to keep data on n0"}


# ---- the head of the queue --------------------------------------------------------------------------------------


def test_the_head_starts_by_the_end_of_the_time_limits_it_waits_for() -> None:
    held = [holding("n0", gpus=4, limit=3600, priority=3), holding("n0", task="x-1", gpus=2, limit=1800, priority=3)]
    plan = run([request(run="big", priority=3, gpus=8)], [machine("n0", gpus=8)], held, now=5)
    assert outcome(plan) == {"big/w-0": "Next to run (priority 3): starts by 2025-01-01 13:00 UTC as running work ends"}


def test_the_start_time_is_rounded_up_to_the_minute() -> None:
    held = [holding("n0", gpus=8, started=30, limit=600)]
    plan = run([request(run="big", gpus=8)], [machine("n0", gpus=8)], held)
    assert outcome(plan) == {"big/w-0": "Next to run (priority 0): starts by 2025-01-01 12:11 UTC as running work ends"}


def test_the_head_picks_the_machine_where_it_starts_soonest() -> None:
    held = [holding("n0", gpus=8, limit=7200), holding("n1", task="x-1", gpus=8, limit=600)]
    plan = run([request(run="big", gpus=8)], [machine("n0", gpus=8), machine("n1", gpus=8)], held)
    assert outcome(plan) == {"big/w-0": "Next to run (priority 0): starts by 2025-01-01 12:10 UTC as running work ends"}


def test_the_head_waits_without_a_time_when_what_it_needs_has_no_limit() -> None:
    held = [holding("n0", gpus=4, limit=600, priority=2), holding("n0", task="x-1", gpus=4, priority=2)]
    plan = run([request(run="big", priority=2, gpus=8)], [machine("n0", gpus=8)], held)
    assert outcome(plan) == {"big/w-0": "Next to run (priority 2): waits for running work to end"}


def test_the_head_explains_every_machine_too() -> None:
    [decision] = run([request(gpus=8)], [machine("n0", gpus=8)], [holding("n0", gpus=4)]).decisions
    assert decision.nodes == [
        NodeReasons(name="n0", reasons=[Reason("InsufficientGpus", "insufficient gpus: need 8, 4 free and usable")])
    ]


# ---- behind the head, and backfill ------------------------------------------------------------------------------

NODES = [machine("n0", gpus=8)]
HELD = [holding("n0", gpus=6, limit=3600, priority=9)]  # ends 13:00: the head (8 GPUs) starts by then


@pytest.mark.parametrize(
    ("behind", "expected"),
    [
        pytest.param(
            request(run="b", priority=1, submitted=1, gpus=4),
            "Queued behind higher-priority work (head)",
            id="a higher-priority head",
        ),
        pytest.param(
            request(run="b", priority=5, submitted=1, gpus=4),
            "Queued behind head, which starts by 2025-01-01 13:00 UTC",
            id="same priority, earlier claim, known start",
        ),
        pytest.param(
            request(run="b", priority=5, submitted=1, gpus=2),
            "Queued behind head, which starts by 2025-01-01 13:00 UTC",
            id="fits now but would delay the head, and has no time limit",
        ),
        pytest.param(
            request(run="b", priority=5, submitted=1, gpus=2, limit=3601),
            "Queued behind head, which starts by 2025-01-01 13:00 UTC",
            id="its time limit ends after the head starts",
        ),
        pytest.param(request(run="b", priority=5, submitted=1, gpus=2, limit=3600), "n0", id="backfill: ends in time"),
        pytest.param(request(run="b", priority=5, submitted=1, gpus=0), "n0", id="fits around the head"),
    ],
)
def test_behind_the_head(behind: TaskRequest, expected: str) -> None:
    head = request(run="head", priority=5, gpus=8)
    assert outcome(run([head, behind], NODES, HELD))["b/w-0"] == expected


def test_queued_behind_a_head_without_a_known_start() -> None:
    plan = run([request(run="head", gpus=8), request(run="b", submitted=1, gpus=4)], NODES, [holding("n0", gpus=6)])
    assert outcome(plan)["b/w-0"] == "Queued behind head"


def test_machines_the_head_does_not_hold_are_free_for_anyone() -> None:
    nodes = [machine("n0", gpus=8), machine("n1", gpus=8)]
    held = [*HELD, holding("n1", task="x-1", gpus=6)]
    plan = run([request(run="head", gpus=8), request(run="b", submitted=1, gpus=2)], nodes, held)
    assert outcome(plan) == {
        "head/w-0": "Next to run (priority 0): starts by 2025-01-01 13:00 UTC as running work ends",
        "b/w-0": "n1",
    }


def test_a_run_that_never_fits_does_not_become_the_head() -> None:
    plan = run([request(run="huge", gpus=64), request(run="b", submitted=1, gpus=2)], NODES, HELD)
    assert outcome(plan) == {"huge/w-0": "No machine fits: 1 of 1 machines ready", "b/w-0": "n0"}


def test_every_blocked_worker_of_the_head_run_holds_room() -> None:
    nodes = [machine("n0", gpus=8), machine("n1", gpus=8)]
    held = [holding("n0", gpus=8, limit=600), holding("n1", task="x-1", gpus=8, limit=1200)]
    plan = run([request("w-0", run="head", gpus=8), request("w-1", run="head", gpus=8)], nodes, held)
    assert outcome(plan) == {
        "head/w-0": "Next to run (priority 0): starts by 2025-01-01 12:10 UTC as running work ends",
        "head/w-1": "Next to run (priority 0): starts by 2025-01-01 12:20 UTC as running work ends",
    }


# ---- privacy ----------------------------------------------------------------------------------------------------


def test_a_head_of_another_namespace_is_not_named() -> None:
    head = request(run="secret", namespace="other", priority=9, gpus=8)
    plan = run([head, request(run="mine", submitted=1, gpus=4)], NODES, HELD)
    assert outcome(plan)["mine/w-0"] == "Queued behind higher-priority work (a job in another namespace)"


# ---- preemption -------------------------------------------------------------------------------------------------


def test_the_head_preempts_lower_priority_work_losing_the_least() -> None:
    nodes = [machine("n0", gpus=8), machine("n1", gpus=8)]
    held = [
        holding("n0", run="old", gpus=8, started=-3600),  # an hour of 8 GPUs
        holding("n1", run="young", task="x-1", gpus=4, started=-60),  # a minute of 4 GPUs
        holding("n1", run="young", task="x-2", gpus=4, started=-120),
    ]
    plan = run([request(run="urgent", priority=10, gpus=8)], nodes, held)
    assert outcome(plan) == {"urgent/w-0": "Preempting 2 lower-priority worker(s) of young to start"}
    assert plan.preemptions == [
        Preemption("job/default/young", ("x-1", "x-2"), "urgent", ("job/default/urgent", "w-0"))
    ]


def test_only_the_workers_needed_are_preempted() -> None:
    held = [holding("n0", run="a1", task="x-0", gpus=2, started=-10), holding("n0", run="a2", task="x-1", gpus=6)]
    plan = run([request(run="urgent", priority=10, gpus=4)], NODES, held)
    assert [p.job_id for p in plan.preemptions] == ["job/default/a2"]


def test_equal_or_higher_priority_work_is_never_preempted() -> None:
    held = [holding("n0", gpus=8, priority=10)]
    plan = run([request(run="urgent", priority=10, gpus=8)], NODES, held)
    assert plan.preemptions == []
    assert outcome(plan) == {"urgent/w-0": "Next to run (priority 10): waits for running work to end"}


def test_nothing_is_preempted_for_a_worker_that_still_would_not_fit() -> None:
    held = [holding("n0", gpus=4, priority=0), holding("n0", task="x-1", gpus=4, priority=20)]
    plan = run([request(run="urgent", priority=10, gpus=8)], NODES, held)
    assert plan.preemptions == []


def test_a_victim_of_another_namespace_is_not_named_and_does_not_see_who() -> None:
    held = [holding("n0", run="theirs", namespace="ns2", gpus=8)]
    plan = run([request(run="urgent", priority=10, gpus=8)], NODES, held)
    assert outcome(plan) == {
        "urgent/w-0": "Preempting 1 lower-priority worker(s) of (a job in another namespace) to start"
    }
    assert [p.by for p in plan.preemptions] == ["(a job in another namespace)"]


def test_a_head_waits_for_its_victims_and_keeps_their_room() -> None:
    victim = holding("n0", run="low", gpus=8)
    head = request(run="urgent", priority=10, gpus=8)
    later = request(run="later", priority=20, submitted=5, gpus=8)
    preempting = {victim.key: head.key}
    plan = run([head, later], NODES, [victim], preempting=preempting)
    assert outcome(plan) == {
        "urgent/w-0": "Starting: waiting for 1 preempted worker(s) to stop",
        "later/w-0": "Queued behind urgent",
    }
    assert plan.preemptions == []


def test_once_its_victims_are_gone_the_head_is_placed() -> None:
    head = request(run="urgent", priority=10, gpus=8)
    plan = run([head], NODES, [], preempting={("job/default/low", "x-0"): head.key})
    assert outcome(plan) == {"urgent/w-0": "n0"}


# ---- quotas -----------------------------------------------------------------------------------------------------

QUOTA = {"default": Quota(namespace="default", gpus=8)}


def test_a_worker_over_its_namespace_quota_waits_and_its_run_records_it() -> None:
    held = [holding("n0", run="mine", gpus=6)]
    [decision] = run([request(gpus=4)], [machine("n0", gpus=16)], held, quotas=QUOTA).decisions
    assert decision.reason == Reason("WaitsForQuota", "Waits for namespace quota: gpus 6 in use + 4 asked > 8")
    assert decision.reached == Reason("QuotaReached", "Quota reached: gpus 6 in use + 4 asked > 8")


def test_a_gang_asks_its_quota_for_every_member_at_once() -> None:
    held = [holding("n0", run="mine", gpus=2)]
    gang = [request(f"w-{i}", gpus=2, gang=True) for i in range(4)]
    plan = run(gang, [machine("n0", gpus=16)], held, quotas=QUOTA)
    assert set(outcome(plan).values()) == {"Gang waits for namespace quota: gpus 2 in use + 8 asked > 8"}
    plan = run(gang, [machine("n0", gpus=16)], quotas=QUOTA)
    assert set(outcome(plan).values()) == {"n0"}, "members placed move from asked to held"


def test_a_worker_asking_more_than_the_quota_at_all() -> None:
    [decision] = run([request(gpus=16)], [machine("n0", gpus=16)], quotas=QUOTA).decisions
    assert decision.reason == Reason(
        "QuotaNeverEnough",
        "Waits for more than the namespace's quota allows at all (gpus 16 asked > 8): raise the quota or ask for less",
    )
    assert decision.reached == Reason("QuotaReached", "Quota reached: gpus 16 asked > 8")


def test_quota_counts_what_the_pass_places() -> None:
    requests = [request(f"w-{i}", gpus=4) for i in range(3)]
    plan = run(requests, [machine("n0", gpus=16)], quotas=QUOTA)
    assert outcome(plan) == {
        "a/w-0": "n0",
        "a/w-1": "n0",
        "a/w-2": "Waits for namespace quota: gpus 8 in use + 4 asked > 8",
    }


def test_waiting_on_quota_never_blocks_another_namespace() -> None:
    requests = [request(run="capped", priority=9, gpus=8), request(run="free", namespace="other", gpus=8)]
    plan = run(requests, [machine("n0", gpus=8)], [holding("n1", run="mine", gpus=8)], quotas=QUOTA)
    assert outcome(plan) == {"capped/w-0": "Waits for namespace quota: gpus 8 in use + 8 asked > 8", "free/w-0": "n0"}


@pytest.mark.parametrize(
    ("quota", "expected"),
    [
        pytest.param(Quota(namespace="default", cpu=2), "Waits for namespace quota: cpu 1.5 in use + 1 asked > 2"),
        pytest.param(
            Quota(namespace="default", memory_bytes=100),
            "Waits for namespace quota: memory_bytes 60 in use + 50 asked > 100",
        ),
    ],
)
def test_quota_of_cpu_and_memory(quota: Quota, expected: str) -> None:
    held = [holding("n0", run="mine", cpu=1.5, memory=60)]
    plan = run([request(cpu=1, memory=50)], [machine("n0")], held, quotas={"default": quota})
    assert outcome(plan) == {"a/w-0": expected}


# ---- arrays and patience ----------------------------------------------------------------------------------------


def test_an_array_runs_at_most_max_parallel_workers() -> None:
    requests = [request(f"w-{i}", max_parallel=2) for i in range(4)]
    plan = run(requests, [machine("n0")], [holding("n0", run="a", task="w-9", group="w")])
    assert outcome(plan) == {
        "a/w-0": "n0",
        "a/w-1": "Array runs at most 2 workers at once",
        "a/w-2": "Array runs at most 2 workers at once",
        "a/w-3": "Array runs at most 2 workers at once",
    }


FABRIC = [machine("eth", gpus=8), machine("ib", gpus=8, ports=[ib(fabric="ib-0")])]


def test_patience_waits_for_the_infiniband_fabric() -> None:
    plan = run([request(gpus=8, topology={"patience_seconds": 600})], FABRIC, [holding("ib", gpus=8)], now=4.5)
    assert outcome(plan) == {
        "a/w-0": "Waiting up to 6 min more for InfiniBand fabric ib-0 (could start now on Ethernet)"
    }
    assert plan.wake_at == at(5)


def test_patience_prefers_the_fabric_when_it_has_room() -> None:
    assert outcome(run([request(gpus=8, topology={"patience_seconds": 600})], FABRIC)) == {"a/w-0": "ib"}


def test_after_its_patience_a_run_starts_on_what_is_there() -> None:
    plan = run([request(gpus=8, topology={"patience_seconds": 600})], FABRIC, [holding("ib", gpus=8)], now=10)
    assert outcome(plan) == {"a/w-0": "eth"}
    assert plan.wake_at is None


def test_patience_counts_from_when_the_worker_began_to_wait() -> None:
    req = request(gpus=8, topology={"patience_seconds": 600}, waiting_since=at(8))
    plan = run([req], FABRIC, [holding("ib", gpus=8)], now=10)
    assert outcome(plan) == {
        "a/w-0": "Waiting up to 8 min more for InfiniBand fabric ib-0 (could start now on Ethernet)"
    }


def test_victims_of_several_runs_are_listed_once_each_and_others_unnamed() -> None:
    held = [
        holding("n0", run="low-a", task="x-0", gpus=2),
        holding("n0", run="low-b", task="x-1", gpus=2),
        holding("n0", run="low-b", task="x-2", gpus=2),
        holding("n0", run="theirs", namespace="ns2", task="x-3", gpus=2),
    ]
    plan = run([request(run="urgent", priority=10, gpus=8)], NODES, held)
    assert outcome(plan) == {
        "urgent/w-0": "Preempting 4 lower-priority worker(s) of (a job in another namespace), low-a, low-b to start"
    }
    assert [(p.job_id, p.task_ids, p.by) for p in plan.preemptions] == [
        ("job/default/low-a", ("x-0",), "urgent"),
        ("job/default/low-b", ("x-1", "x-2"), "urgent"),
        ("job/ns2/theirs", ("x-3",), "(a job in another namespace)"),
    ]


def test_a_head_whose_machine_went_away_queues_again() -> None:
    victim = holding("n0", run="low", gpus=8)
    head = request(run="urgent", priority=10, gpus=8)
    nodes = [machine("n0", gpus=8, cordon="repairs"), machine("n1", gpus=8)]
    plan = run([head], nodes, [victim], preempting={victim.key: head.key})
    assert outcome(plan) == {"urgent/w-0": "n1"}


def test_a_patient_run_follows_its_own_fabric() -> None:
    nodes = [
        machine("a", gpus=8, ports=[ib(fabric="ib-0")]),
        machine("b", gpus=8, ports=[ib(fabric="ib-1")]),
        machine("c", gpus=8),
    ]
    placed = [holding("b", run="a", task="w-0", group="w", gpus=4)]
    req = request("w-1", gpus=8, topology={"patience_seconds": 600})
    assert outcome(run([req], nodes, placed)) == {
        "a/w-1": "Waiting up to 10 min more for InfiniBand fabric ib-1 (could start now on Ethernet)"
    }


# ---- machines compiled once ---------------------------------------------------------------------------------------


def test_a_machine_is_compiled_again_only_when_its_view_is_new() -> None:
    compiled = Compiled()
    n0, n1 = machine("n0", gpus=8), machine("n1", gpus=8)
    first = compiled([n1, n0])
    assert list(first) == ["n0", "n1"]

    cordoned = n1.model_copy(update={"cordon": "Disk check"})
    second = compiled([n0, cordoned])
    assert second["n0"] is first["n0"]
    assert second["n1"] is not first["n1"] and second["n1"].closed == R.Cordoned(why="Disk check")
    assert list(compiled([cordoned])) == ["n1"]  # a machine gone is forgotten


def test_passes_that_keep_their_machines_decide_as_passes_that_compile_them() -> None:
    nodes = [machine("n0", gpus=8), machine("n1", gpus=4), machine("n2", gpus=8, cordon="Disk check")]
    compiled = Compiled()
    held = [holding("n0", gpus=6)]
    for requests in ([request(gpus=4)], [request(gpus=2), request("w-1", gpus=4)], [request(gpus=8)]):
        assert outcome(run(requests, nodes, held, compiled=compiled)) == outcome(run(requests, nodes, held))
        held = [*held, holding("n1", run=f"r{len(held)}", gpus=1)]


def view_of(cluster: Cluster) -> dict[str, object]:
    """Everything a pass reads of its cluster as it begins; a run or group that holds nothing is as if unknown."""
    return {
        "free": {name: (round(f.cpu, 9), f.memory_bytes, f.gpus) for name, f in cluster.free.items()},
        "held": {name: sorted(held) for name, held in cluster.held.items()},
        "allocations": dict(sorted(cluster.allocations.items())),
        "run_nodes": {job: dict(sorted(nodes.items())) for job, nodes in sorted(cluster.run_nodes.items()) if nodes},
        "group_nodes": {k: dict(sorted(nodes.items())) for k, nodes in sorted(cluster.group_nodes.items()) if nodes},
        "group_placed": {k: n for k, n in sorted(cluster.group_placed.items()) if n},
        "index": [[(round(cpu, 9), memory, name) for cpu, memory, name in b] for b in _trimmed(cluster._buckets)],
    }


def _trimmed(buckets: list[list[tuple[float, int, str]]]) -> list[list[tuple[float, int, str]]]:
    """The index without its empty buckets past the last machine: no request sees those."""
    last = max((gpus for gpus, bucket in enumerate(buckets) if bucket), default=-1)
    return buckets[: last + 1]


def test_holdings_kept_from_pass_to_pass_are_those_held_anew_as_workers_come_go_and_machines_change() -> None:
    """The service's passes keep what placed workers hold and change it by what came and went: after hundreds of
    passes of placements, releases, new attempts of the same worker, fractional cpus and a machine cordoned and
    back, each pass begins from the view a pass holding every allocation anew has, and decides the same."""
    rng = random.Random(7)
    nodes = [machine(f"n{i}", cpus=16, gpus=8) for i in range(6)]
    compiled = Compiled()
    held: dict[tuple[str, str], Allocation] = {}
    for step in range(300):
        for _ in range(rng.randint(0, 4)):  # placements, some of them a new attempt of a worker that holds room
            job, task = f"r{rng.randint(0, 30)}", f"w-{rng.randint(0, 2)}"
            alloc = holding(
                f"n{rng.randint(0, 6)}",  # n6 is no machine the pass knows: held all the same
                run=job, task=task, cpu=rng.choice([0.1, 0.25, 0.5, 1.3]), gpus=rng.randint(0, 2), group=f"g{task[-1]}",
            )  # fmt: skip
            held[alloc.key] = alloc
        for key in rng.sample(sorted(held), k=min(len(held), rng.randint(0, 3))):
            del held[key]
        if step % 50 == 25:
            nodes[2] = nodes[2].model_copy(update={"cordon": None if nodes[2].cordon else "Disk check"})
        allocations = list(held.values())
        kept = Cluster(nodes, allocations, at(0), compiled)
        assert view_of(kept) == view_of(Cluster(nodes, allocations, at(0)))
        # A worker of a run that holds room: its pass changes counts the kept holdings share with it, on its own copy
        asked = [request(f"q-{step}", run=f"r{rng.randint(0, 30)}", group=f"g{rng.randint(0, 2)}", cpu=0.5, gpus=1)]
        plan = run(asked, nodes, allocations, compiled=compiled)
        assert outcome(plan) == outcome(run(asked, nodes, allocations))


def test_holdings_given_one_worker_twice_are_held_as_given() -> None:
    nodes, compiled = [machine("n0", gpus=8), machine("n1", gpus=8)], Compiled()
    first = holding("n0", run="r", task="w-0", gpus=2)
    Cluster(nodes, [first], at(0), compiled)
    for allocations in ([first, holding("n1", run="r", task="w-0", gpus=1)], [first, first], [first]):
        assert view_of(Cluster(nodes, allocations, at(0), compiled)) == view_of(Cluster(nodes, allocations, at(0)))
