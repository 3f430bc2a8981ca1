"""What the console shows as free room and use: each machine's capacity less what its placed workers hold, each
workspace's use as its quota counts it; a machine that never reported its capacity is left out."""

from __future__ import annotations

from tests.domain.builders import holding, machine, unreported
from workflows.domain.scheduling.use import ClusterUse, MachineRoom, PlacedWorker, WorkspaceUse, cluster_use


def test_free_room_and_use_count_every_placed_worker() -> None:
    nodes = [machine("n1", cpus=8, memory=1000, gpus=4), machine("n0", cpus=16, memory=1000, gpus=8), unreported("n2")]
    allocations = [
        holding("n0", namespace="research", cpu=2, memory=100, gpus=1),
        holding("n0", namespace="research", run="b", cpu=1.5, memory=50, gpus=2, task="x-1"),
        holding("n1", namespace="team-a", cpu=1, memory=10, gpus=4),
    ]
    assert cluster_use(nodes, allocations) == ClusterUse(
        machines=[
            MachineRoom(
                name="n0",
                gpus=5,
                cpu=12.5,
                memory_bytes=850,
                workers=2,
                placed=[
                    PlacedWorker(namespace="research", run="b", task="x-1", gpus=2, cpu=1.5, memory_bytes=50),
                    PlacedWorker(namespace="research", run="other", task="x-0", gpus=1, cpu=2, memory_bytes=100),
                ],
            ),
            MachineRoom(
                name="n1",
                gpus=0,
                cpu=7,
                memory_bytes=990,
                workers=1,
                placed=[
                    PlacedWorker(namespace="team-a", run="other", task="x-0", gpus=4, cpu=1, memory_bytes=10),
                ],
            ),
        ],
        workspaces=[
            WorkspaceUse(namespace="research", gpus=3, cpu=3.5, memory_bytes=150, workers=2),
            WorkspaceUse(namespace="team-a", gpus=4, cpu=1, memory_bytes=10, workers=1),
        ],
    )


def test_an_idle_cluster_is_all_free_and_no_workspace_uses_anything() -> None:
    assert cluster_use([machine("n0", cpus=4, memory=64, gpus=2)], []) == ClusterUse(
        machines=[MachineRoom(name="n0", gpus=2, cpu=4, memory_bytes=64, workers=0, placed=[])], workspaces=[]
    )


def test_a_workspace_sees_its_own_workers_on_a_machine_and_only_a_count_of_the_others() -> None:
    nodes = [machine("n0", cpus=8, memory=1000, gpus=4)]
    allocations = [holding("n0", namespace="research", gpus=1), holding("n0", namespace="team-a", gpus=2)]
    (room,) = cluster_use(nodes, allocations).machines
    seen = room.seen_by("team-a")
    assert (seen.workers, seen.gpus, [(p.namespace, p.run, p.task) for p in seen.placed]) == (
        2,
        1,
        [("team-a", "other", "x-0")],
    )
