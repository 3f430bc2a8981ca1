"""`decide` driven through whole stories with fixed times: every history entry and every command."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from workflows.domain.reasons import NodeReasons, R, Reason
from workflows.domain.run.events import (
    ArmTimer,
    CancelRequested,
    Command,
    Created,
    Event,
    ExitedWhileLost,
    HeartbeatLate,
    MachineLost,
    Place,
    PlacementUpdate,
    Release,
    Start,
    Stop,
    StopRequested,
    TaskEnded,
    TaskRunning,
    TaskSetupFailed,
    TaskStarted,
    Timer,
    TimerFired,
)
from workflows.domain.run.job import FirstPlacement, decide, first_requests, is_settled
from workflows.domain.run.status import LastFailure, Placement, PlacementNode
from workflows.domain.run.tasks import new_job
from workflows.domain.run.views import describe
from workflows.domain.scheduling.placement import TaskRequest
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, parse_spec
from workflows.messages import PROTOCOL

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
JOB_ID = "job/default/hello"


def at(second: float) -> datetime:
    return T0 + timedelta(seconds=second)


def hello(replicas: int = 2, policy: str = "OnFailure", **group: Any) -> JobSpec:
    return parse_spec(
        {
            "name": "hello",
            "groups": [
                {"name": "w", "replicas": replicas, "command": ["python", "-c", "print(1)"], "restart_policy": policy}
                | group
            ],
        }
    )


def ask(task: str, index: int, attempt: int = 0, since: float = 1, **resources: Any) -> TaskRequest:
    """The placement request `decide` sends for a worker of `hello` that waits since second `since`."""
    return TaskRequest(
        job_id=JOB_ID,
        namespace="default",
        task_id=task,
        index=index,
        attempt=attempt,
        priority=0,
        submitted_at=T0,
        cpu=resources.get("cpu", 1.0),
        memory_bytes=resources.get("memory_bytes", 0),
        gpus=resources.get("gpus", 0),
        group="w",
        waiting_since=at(since),
    )


def worker_env(task: str, rank: int, world: int, run: str = "hello") -> dict[str, str]:
    """What the run adds to a worker's environment (not a gang: no MASTER_ADDR)."""
    index = task.rsplit("-", 1)[1]
    return {
        "ASTRAEUS_RUN": run,
        "ASTRAEUS_NAMESPACE": "default",
        "ASTRAEUS_TASK": task,
        "ASTRAEUS_INDEX": index,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
    }


class Story:
    """One run, driven event batch by event batch; `job` is always the latest record."""

    def __init__(self, spec: JobSpec, settings: Settings | None = None) -> None:
        self.spec = spec
        self.job = new_job(spec, settings or Settings(), T0)
        self.resets: list[Command] = []

    def step(self, second: float, *events: Event) -> list[Command]:
        """Decide a batch; returns its commands but the 10-minute reset timers, kept in `resets`
        (test_a_running_worker_arms_its_reset_and_time_limit_timers covers them)."""
        self.job, commands = decide(self.job, list(events), at(second))
        self.resets += [c for c in commands if isinstance(c, ArmTimer) and c.timer is Timer.RESET]
        return [c for c in commands if not (isinstance(c, ArmTimer) and c.timer is Timer.RESET)]

    def start(self, second: float, task: str, node: str, attempt: int = 0) -> list[Command]:
        return self.step(second, PlacementUpdate(task_id=task, attempt=attempt, node=node))

    def run_history(self) -> list[tuple[str, str]]:
        return [(entry.state, entry.reason) for entry in self.job.history]

    def history(self, task: str) -> list[tuple[str, str]]:
        return [(entry.state, entry.reason) for entry in self.job.task(task).history]

    def status(self, task: str | None = None) -> tuple[str, str]:
        status = self.job.task(task).status if task else self.job.status
        return (status.state, status.reason)

    def group(self) -> Any:
        return self.spec.groups[0]


def running_story(replicas: int = 2, policy: str = "OnFailure", settings: Settings | None = None) -> Story:
    """Created at 1 s; w-i placed on n-i at 2 s; containers started at 3 s; running at 4 s."""
    story = Story(hello(replicas, policy), settings)
    ids = [f"w-{i}" for i in range(replicas)]
    story.step(1, Created())
    story.step(2, *[PlacementUpdate(task_id=t, attempt=0, node=f"n{i}") for i, t in enumerate(ids)])
    story.step(3, *[TaskStarted(task_id=t, attempt=0) for t in ids])
    story.step(4, *[TaskRunning(task_id=t, attempt=0) for t in ids])
    return story


RUN_UP_TO_RUNNING = [
    ("Pending", "Run created"),
    ("Pending", "Waiting for workers to be created"),
    ("Pending", "Waiting for workers to start"),
    ("Pending", "Placed on n0"),
    ("Pending", "Container started"),
]


def worker_up_to_running(node: str) -> list[tuple[str, str]]:
    return [
        ("Pending", "Waiting for workers to start"),
        ("Preparing", f"Placed on {node}"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
    ]


# ---- the hello path -------------------------------------------------------------------------------------------


def test_the_hello_path() -> None:
    story = Story(hello())
    group = story.group()
    assert story.run_history() == [("Pending", "Run created")]

    assert story.step(1, Created()) == [Place(requests=[ask("w-0", 0), ask("w-1", 1)])]
    assert story.step(
        2,
        PlacementUpdate(task_id="w-0", attempt=0, node="n0"),
        PlacementUpdate(task_id="w-1", attempt=0, node="n1"),
    ) == [
        Start(task_id="w-0", attempt=0, node="n0", group=group, env=worker_env("w-0", rank=0, world=2)),
        Start(task_id="w-1", attempt=0, node="n1", group=group, env=worker_env("w-1", rank=1, world=2)),
    ]
    assert story.step(3, TaskStarted(task_id="w-0", attempt=0), TaskStarted(task_id="w-1", attempt=0)) == []
    assert story.step(4, TaskRunning(task_id="w-0", attempt=0), TaskRunning(task_id="w-1", attempt=0)) == []
    assert story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=0)) == [Release(task_id="w-0", attempt=0)]
    assert not is_settled(story.job)
    assert story.step(6, TaskEnded(task_id="w-1", attempt=0, exit_code=0)) == [Release(task_id="w-1", attempt=0)]
    assert is_settled(story.job)

    assert story.run_history() == [
        *RUN_UP_TO_RUNNING,
        ("Running", "1 of 2 workers running"),  # each running report is shown as it is handled
        ("Running", "2 of 2 workers running"),
        ("Running", "1 of 2 workers running"),
        ("Completed", "All workers completed"),
    ]
    assert [entry.at for entry in story.job.history] == [T0, at(1), at(1), at(2), at(3), at(4), at(4), at(5), at(6)]
    assert story.history("w-0") == [*worker_up_to_running("n0"), ("Completed", "Exited with code 0")]
    assert story.history("w-1") == [*worker_up_to_running("n1"), ("Completed", "Exited with code 0")]
    status = story.job.status
    assert (status.created_at, status.started_at, status.finished_at) == (T0, at(4), at(6))
    w0 = story.job.task("w-0").status
    assert (w0.created_at, w0.started_at, w0.finished_at) == (at(1), at(4), at(5))
    assert story.job.task("w-0").last_failure is None


def test_a_new_run_is_pending_run_created() -> None:
    job = new_job(hello(), Settings(), T0)
    assert (job.status.state, job.status.reason, job.status.code) == ("Pending", "Run created", "RunCreated")
    assert job.tasks == []
    assert not is_settled(job)


def test_decide_leaves_its_input_alone() -> None:
    story = running_story()
    before = story.job.model_dump()
    after, _ = decide(story.job, [TaskEnded(task_id="w-0", attempt=0, exit_code=3)], at(5))
    assert story.job.model_dump() == before
    # What a decision changes is its own copy; the frozen spec and settings it shares
    assert after.tasks[0] is not story.job.tasks[0] and after.status is not story.job.status
    assert after.spec is story.job.spec and after.settings is story.job.settings


def test_a_worker_that_ends_before_its_running_report_ran() -> None:
    story = Story(hello(1))
    story.step(1, Created())
    story.start(2, "w-0", "n0")
    story.step(3, TaskStarted(task_id="w-0", attempt=0), TaskEnded(task_id="w-0", attempt=0, exit_code=0))
    assert story.history("w-0") == [*worker_up_to_running("n0"), ("Completed", "Exited with code 0")]
    assert story.status() == ("Completed", "All workers completed")


def test_a_worker_the_scheduler_cannot_place_shows_why_and_so_does_the_run() -> None:
    story = Story(hello(1, gpus=8))
    assert story.step(1, Created()) == [Place(requests=[ask("w-0", 0, gpus=8)])]
    nodes = [NodeReasons(name="n0", reasons=[R.InsufficientGpus(need=8, free=4)])]
    waiting = PlacementUpdate(task_id="w-0", attempt=0, reason=R.NoMachineFits(ready=1, total=1), nodes=nodes)
    assert story.step(2, waiting) == []
    assert story.history("w-0") == [
        ("Pending", "Waiting for workers to start"),
        ("Pending", "No machine fits: 1 of 1 machines ready"),
    ]
    assert story.run_history()[-1] == ("Pending", "No machine fits: 1 of 1 machines ready")
    assert story.job.status.code == "NoMachineFits"
    assert describe(story.job).placement == Placement(
        nodes=[PlacementNode(name="n0", reasons=["insufficient gpus: need 8, 4 free and usable"])],
        counts={"InsufficientGpus": 1},
    )


# ---- failures -------------------------------------------------------------------------------------------------


def test_exit_3_with_restart_policy_never_fails_the_run_and_stops_the_rest() -> None:
    story = running_story(policy="Never")
    ended = TaskEnded(task_id="w-0", attempt=0, exit_code=3, log_tail="Traceback\nValueError: 3\n")
    assert story.step(5, ended) == [Release(task_id="w-0", attempt=0), Stop(task_id="w-1", attempt=0, node="n1")]
    assert story.status() == ("Failed", "Worker w-0 failed on n0: Exited with code 3")
    assert story.history("w-0") == [*worker_up_to_running("n0"), ("Failed", "Exited with code 3")]
    assert story.history("w-1") == [
        *worker_up_to_running("n1"),
        ("Stopping", "A worker failed, and the run fails on a failure"),
    ]
    assert story.job.task("w-0").last_failure == LastFailure(
        exit_code=3, reason="Exited with code 3", log_tail="Traceback\nValueError: 3\n"
    )
    assert story.job.status.finished_at == at(5)
    assert not is_settled(story.job)

    assert story.step(6, TaskEnded(task_id="w-1", attempt=0, exit_code=143)) == [Release(task_id="w-1", attempt=0)]
    assert story.history("w-1")[-1] == ("Cancelled", "Stopped on request")
    assert story.run_history() == [
        *RUN_UP_TO_RUNNING,
        ("Running", "1 of 2 workers running"),
        ("Running", "2 of 2 workers running"),
        ("Failed", "Worker w-0 failed on n0: Exited with code 3"),
    ]
    assert is_settled(story.job)


@pytest.mark.parametrize(
    ("ended", "reason", "exit_code"),
    [
        pytest.param(
            TaskEnded(task_id="w-0", attempt=0, exit_code=137, oom=True),
            "OOMKilled: the container exceeded its memory limit",
            137,
            id="out of memory is reported as OOMKilled",
        ),
        pytest.param(
            TaskEnded(task_id="w-0", attempt=0, exit_code=1),
            "Exited with code 1",
            1,
            id="exit 1 is the program's own error",
        ),
        pytest.param(
            TaskEnded(task_id="w-0", attempt=0, exit_code=126),
            "Exited with code 126",
            126,
            id="exit 126 is a command that is not executable",
        ),
        pytest.param(
            TaskEnded(task_id="w-0", attempt=0, exit_code=127),
            "Exited with code 127",
            127,
            id="exit 127 is a command not found in the image",
        ),
        pytest.param(
            TaskEnded(task_id="w-0", attempt=0, exit_code=137),
            "Exited with code 137",
            137,
            id="exit 137 is a SIGKILL that is not OOM",
        ),
        pytest.param(
            TaskEnded(task_id="w-0", attempt=0, exit_code=143),
            "Exited with code 143",
            143,
            id="exit 143 is a SIGTERM outside a stop",
        ),
        pytest.param(
            TaskEnded(task_id="w-0", attempt=0, not_found=True),
            "Container not found on the node",
            None,
            id="a container that disappeared fails",
        ),
    ],
)
def test_a_failed_exit_fails_the_worker_and_the_run(ended: TaskEnded, reason: str, exit_code: int | None) -> None:
    story = running_story(1, policy="Never")
    story.step(5, ended)
    assert story.history("w-0") == [*worker_up_to_running("n0"), ("Failed", reason)]
    assert story.status() == ("Failed", f"Worker w-0 failed on n0: {reason}")
    assert story.job.task("w-0").last_failure == LastFailure(exit_code=exit_code, reason=reason, log_tail="")
    assert is_settled(story.job)


def test_a_setup_failure_fails_the_worker_without_an_exit_code() -> None:
    story = Story(hello(1, "Never"))
    story.step(1, Created())
    story.start(2, "w-0", "n0")
    failed = TaskSetupFailed(task_id="w-0", attempt=0, reason=Reason("ErrImagePull", "ErrImagePull: manifest unknown"))
    assert story.step(3, failed) == [Release(task_id="w-0", attempt=0)]
    assert story.history("w-0") == [
        ("Pending", "Waiting for workers to start"),
        ("Preparing", "Placed on n0"),
        ("Failed", "ErrImagePull: manifest unknown"),
    ]
    assert story.job.task("w-0").status.code == "ErrImagePull"
    assert story.job.task("w-0").last_failure == LastFailure(
        exit_code=None, reason="ErrImagePull: manifest unknown", log_tail=""
    )
    assert story.status() == ("Failed", "Worker w-0 failed on n0: ErrImagePull: manifest unknown")


def test_two_workers_failing_together_are_counted() -> None:
    story = running_story(3, policy="Never")
    story.step(
        5,
        TaskEnded(task_id="w-0", attempt=0, exit_code=3),
        TaskEnded(task_id="w-1", attempt=0, oom=True, exit_code=137),
    )
    assert story.status() == ("Failed", "2 of 3 workers failed; the first: Worker w-0 failed on n0: Exited with code 3")
    assert story.history("w-2")[-1] == ("Stopping", "A worker failed, and the run fails on a failure")


def test_exit_0_completes_a_worker_and_onfailure_does_not_restart_it() -> None:
    story = running_story(2)
    assert story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=0)) == [Release(task_id="w-0", attempt=0)]
    assert story.job.task("w-0").final
    assert story.status() == ("Running", "1 of 2 workers running")


def test_always_restarts_a_completed_worker() -> None:
    story = running_story(1, policy="Always")
    assert story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=0)) == [
        Release(task_id="w-0", attempt=0),
        ArmTimer(timer=Timer.RESTART, task_id="w-0", attempt=0, at=at(15)),
    ]
    assert story.step(15, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0)) == [
        Place(requests=[ask("w-0", 0, attempt=1, since=15)])
    ]
    assert story.history("w-0")[-2:] == [
        ("Completed", "Exited with code 0"),
        ("Pending", "Restarted by policy (restart 1/10)"),
    ]


# ---- cancel and stop ------------------------------------------------------------------------------------------


def test_cancel_stops_the_running_and_cancels_the_waiting() -> None:
    story = Story(hello())
    story.step(1, Created())
    story.start(2, "w-0", "n0")
    story.step(3, TaskStarted(task_id="w-0", attempt=0))
    story.step(4, TaskRunning(task_id="w-0", attempt=0))
    assert story.step(5, CancelRequested()) == [
        Stop(task_id="w-0", attempt=0, node="n0"),
        Release(task_id="w-1", attempt=0),
    ]
    assert story.status() == ("Running", "1 of 2 workers running")
    assert story.history("w-0")[-1] == ("Stopping", "Run cancelled")
    assert story.history("w-1") == [("Pending", "Waiting for workers to start"), ("Cancelled", "Run cancelled")]
    assert not is_settled(story.job)

    assert story.step(6, TaskEnded(task_id="w-0", attempt=0, exit_code=137)) == [Release(task_id="w-0", attempt=0)]
    assert story.history("w-0") == [
        *worker_up_to_running("n0"),
        ("Stopping", "Run cancelled"),
        ("Cancelled", "Stopped on request"),
    ]
    assert story.run_history() == [
        ("Pending", "Run created"),
        ("Pending", "Waiting for workers to be created"),
        ("Pending", "Waiting for workers to start"),
        ("Running", "1 of 2 workers running"),
        ("Cancelled", "All workers ended; some were cancelled"),
    ]
    assert story.job.task("w-0").last_failure is None
    assert is_settled(story.job)


def test_a_cancel_for_a_delete_stops_the_workers_with_run_deleted_and_ends_the_run_cancelled() -> None:
    story = Story(hello())
    story.step(1, Created())
    story.start(2, "w-0", "n0")
    story.step(3, TaskStarted(task_id="w-0", attempt=0))
    story.step(4, TaskRunning(task_id="w-0", attempt=0))
    assert story.step(5, CancelRequested(deleting=True)) == [
        Stop(task_id="w-0", attempt=0, node="n0"),
        Release(task_id="w-1", attempt=0),
    ]
    assert story.history("w-0")[-1] == ("Stopping", "Run deleted")
    assert story.history("w-1")[-1] == ("Cancelled", "Run deleted")
    story.step(6, TaskEnded(task_id="w-0", attempt=0, exit_code=143))
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")
    assert story.step(7, CancelRequested(deleting=True)) == []  # a run that ended: nothing more


def test_a_placement_that_arrives_after_a_cancel_gives_its_room_back() -> None:
    story = Story(hello(1))
    story.step(1, Created())
    story.step(2, CancelRequested())
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")
    before = story.job.model_dump()
    assert story.start(3, "w-0", "n0") == [Release(task_id="w-0", attempt=0)]
    assert story.job.model_dump() == before


def test_cancel_of_a_pending_run_ends_it_at_once() -> None:
    story = Story(hello())
    story.step(1, Created())
    assert story.step(2, CancelRequested()) == [Release(task_id="w-0", attempt=0), Release(task_id="w-1", attempt=0)]
    assert story.run_history()[-1] == ("Cancelled", "All workers ended; some were cancelled")
    assert is_settled(story.job)


@pytest.mark.parametrize(
    ("policy", "event"),
    [
        pytest.param("Never", CancelRequested(), id="a second cancel of a run being cancelled"),
        pytest.param("Never", TaskEnded(task_id="w-0", attempt=0, exit_code=0), id="a cancel of a completed run"),
        pytest.param("Never", TaskEnded(task_id="w-0", attempt=0, exit_code=3), id="a cancel of a failed run"),
    ],
)
def test_a_cancel_request_to_a_run_being_cancelled_or_ended_changes_nothing(policy: str, event: Event) -> None:
    # Temporal's cancellation request (the UI's button) may follow `astraeus cancel`, or reach a run that just ended.
    story = running_story(1, policy)
    story.step(5, event)
    before = story.job.model_dump()
    assert story.step(6, CancelRequested()) == []
    assert story.job.model_dump() == before


def test_a_worker_stopping_ends_cancelled_whatever_its_exit_code() -> None:
    story = running_story(1)
    story.step(5, CancelRequested())
    story.step(6, TaskEnded(task_id="w-0", attempt=0, exit_code=3, log_tail="killed\n"))
    assert story.history("w-0")[-1] == ("Cancelled", "Stopped on request")
    assert story.job.task("w-0").last_failure is None
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")


def test_a_worker_stopped_while_preparing_ends_cancelled_when_its_start_fails() -> None:
    story = Story(hello(1))
    story.step(1, Created())
    story.start(2, "w-0", "n0")
    assert story.step(3, CancelRequested()) == [Stop(task_id="w-0", attempt=0, node="n0")]
    failed = TaskSetupFailed(
        task_id="w-0", attempt=0, reason=Reason("ContainerStartFailed", "Container start failed: x")
    )
    assert story.step(4, failed) == [Release(task_id="w-0", attempt=0)]
    assert story.history("w-0")[-2:] == [("Stopping", "Run cancelled"), ("Cancelled", "Stopped on request")]
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")


@pytest.mark.parametrize(
    ("stop", "reason"),
    [
        pytest.param(
            StopRequested(task_id="w-0"), "Stopped by scheduler", id="a stop without reason says by scheduler"
        ),
        pytest.param(
            StopRequested(task_id="w-0", reason="Drained for maintenance"),
            "Drained for maintenance",
            id="a stop with a reason keeps it",
        ),
    ],
)
def test_stop_one_worker(stop: StopRequested, reason: str) -> None:
    story = running_story(2)
    assert story.step(5, stop) == [Stop(task_id="w-0", attempt=0, node="n0")]
    assert story.history("w-0")[-1] == ("Stopping", reason)
    assert story.job.task("w-0").status.code == "StoppedByScheduler"
    assert story.status() == ("Running", "1 of 2 workers running")

    assert story.step(6, TaskEnded(task_id="w-0", attempt=0, exit_code=143)) == [Release(task_id="w-0", attempt=0)]
    assert story.history("w-0") == [
        *worker_up_to_running("n0"),
        ("Stopping", reason),
        ("Cancelled", "Stopped on request"),
    ]
    assert story.job.task("w-0").final

    story.step(7, TaskEnded(task_id="w-1", attempt=0, exit_code=0))
    assert story.run_history()[-3:] == [
        ("Running", "2 of 2 workers running"),
        ("Running", "1 of 2 workers running"),
        ("Cancelled", "All workers ended; some were cancelled"),
    ]


def test_stop_a_waiting_worker_cancels_it_at_once() -> None:
    story = Story(hello())
    story.step(1, Created())
    assert story.step(2, StopRequested(task_id="w-1")) == [Release(task_id="w-1", attempt=0)]
    assert story.history("w-1") == [("Pending", "Waiting for workers to start"), ("Cancelled", "Stopped by scheduler")]
    assert story.status() == ("Pending", "Waiting for workers to start")


# ---- restarts -------------------------------------------------------------------------------------------------


def test_onfailure_restarts_after_the_backoff() -> None:
    story = running_story(1)
    assert story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1)) == [
        Release(task_id="w-0", attempt=0),
        ArmTimer(timer=Timer.RESTART, task_id="w-0", attempt=0, at=at(20)),
    ]
    task = story.job.task("w-0")
    assert (task.state, task.final, task.restart_at, task.restarts) == ("Failed", False, at(20), 0)
    assert story.status() == ("Pending", "Exited with code 1")

    assert story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0)) == [
        Place(requests=[ask("w-0", 0, attempt=1, since=20)])
    ]
    task = story.job.task("w-0")
    assert (task.attempt.number, task.restarts, task.node, task.restart_at) == (1, 1, None, None)
    assert story.history("w-0") == [
        *worker_up_to_running("n0"),
        ("Failed", "Exited with code 1"),
        ("Pending", "Restarted by policy (restart 1/10)"),
    ]
    assert story.job.task("w-0").status.code == "RestartedByPolicy"

    group = story.group()
    env = worker_env("w-0", rank=0, world=1)
    assert story.start(21, "w-0", "n1", attempt=1) == [Start(task_id="w-0", attempt=1, node="n1", group=group, env=env)]
    assert story.run_history() == [
        *RUN_UP_TO_RUNNING,
        ("Running", "1 of 1 workers running"),
        ("Pending", "Exited with code 1"),
        ("Pending", "Restarted by policy (restart 1/10)"),
        ("Pending", "Placed on n1"),
    ]


def test_events_about_an_older_attempt_are_ignored() -> None:
    story = running_story(1)
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    before = story.job.model_dump()
    stale: list[Event] = [
        TaskStarted(task_id="w-0", attempt=0),
        TaskRunning(task_id="w-0", attempt=0),
        TaskEnded(task_id="w-0", attempt=0, exit_code=0),
        TaskSetupFailed(task_id="w-0", attempt=0, reason=Reason("ErrImagePull", "ErrImagePull: x")),
        TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0),
        PlacementUpdate(
            task_id="w-0", attempt=0, reason=Reason("NoMachineFits", "No machine fits: 0 of 1 machines ready")
        ),
    ]
    for second, event in enumerate(stale, start=21):
        assert story.step(second, event) == []
    assert story.job.model_dump() == before
    assert story.start(30, "w-0", "n0", attempt=0) == [Release(task_id="w-0", attempt=0)]
    assert story.job.model_dump() == before


def test_events_about_unknown_workers_are_ignored() -> None:
    story = running_story(1)
    before = story.job.model_dump()
    for event in (
        TaskStarted(task_id="ghost-0", attempt=0),
        TaskRunning(task_id="ghost-0", attempt=0),
        TaskEnded(task_id="ghost-0", attempt=0, exit_code=1),
        TimerFired(timer=Timer.RESTART, task_id="ghost-0", attempt=0),
    ):
        assert story.step(5, event) == []
    assert story.start(5, "ghost-0", "n0") == [Release(task_id="ghost-0", attempt=0)]
    assert story.job.model_dump() == before


def test_the_budget_makes_a_failure_final() -> None:
    shrunk = Settings(backoff_base_seconds=1, restart_budget=1, restart_reset_seconds=600)
    story = running_story(1, settings=shrunk)
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(11, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    story.start(12, "w-0", "n1", attempt=1)
    story.step(13, TaskStarted(task_id="w-0", attempt=1))
    story.step(14, TaskRunning(task_id="w-0", attempt=1))
    assert story.step(15, TaskEnded(task_id="w-0", attempt=1, exit_code=2)) == [Release(task_id="w-0", attempt=1)]
    assert story.history("w-0")[-6:] == [
        ("Pending", "Restarted by policy (restart 1/1)"),
        ("Preparing", "Placed on n1"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
        ("Failed", "Exited with code 2"),
        ("Failed", "Retry budget exhausted after 1/1 restarts"),
    ]
    assert story.job.task("w-0").final
    assert story.status() == ("Failed", "Worker w-0 failed on n1: Retry budget exhausted after 1/1 restarts")
    assert is_settled(story.job)


def test_running_long_enough_resets_the_count() -> None:
    shrunk = Settings(backoff_base_seconds=1, restart_budget=1, restart_reset_seconds=5)
    story = running_story(1, settings=shrunk)
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(11, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    story.start(12, "w-0", "n0", attempt=1)
    story.step(13, TaskStarted(task_id="w-0", attempt=1))
    story.step(14, TaskRunning(task_id="w-0", attempt=1))
    # Running from 14 s to 19 s: the reset window of 5 s, so the spent budget is refilled.
    assert story.step(19, TaskEnded(task_id="w-0", attempt=1, exit_code=1)) == [
        Release(task_id="w-0", attempt=1),
        ArmTimer(timer=Timer.RESTART, task_id="w-0", attempt=1, at=at(20)),
    ]
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=1))
    assert story.history("w-0")[-1] == ("Pending", "Restarted by policy (restart 1/1)")
    assert story.job.task("w-0").attempt.number == 2


def test_the_reset_timer_sets_the_count_to_zero_after_ten_minutes_running() -> None:
    story = running_story(1)
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    story.start(21, "w-0", "n0", attempt=1)
    story.step(22, TaskStarted(task_id="w-0", attempt=1))
    story.step(23, TaskRunning(task_id="w-0", attempt=1))
    assert story.resets[-1] == ArmTimer(timer=Timer.RESET, task_id="w-0", attempt=1, at=at(623))
    assert story.job.task("w-0").restarts == 1
    story.step(623, TimerFired(timer=Timer.RESET, task_id="w-0", attempt=1))
    assert story.job.task("w-0").restarts == 0  # shown at once, not only at the next failure
    story.step(700, TaskEnded(task_id="w-0", attempt=1, exit_code=1))
    story.step(710, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=1))
    assert story.history("w-0")[-1] == ("Pending", "Restarted by policy (restart 1/10)")


def test_a_reset_timer_of_an_earlier_attempt_changes_nothing() -> None:
    story = running_story(1)
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    before = story.job.model_dump()
    story.step(604, TimerFired(timer=Timer.RESET, task_id="w-0", attempt=0))
    assert story.job.model_dump() == before


def test_a_restart_due_for_a_worker_that_was_stopped_meanwhile_is_ignored() -> None:
    story = running_story(2)
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(11, CancelRequested())
    before = story.job.task("w-0").model_dump()
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    assert story.job.task("w-0").model_dump() == before


def test_the_same_grant_again_is_already_carried_out() -> None:
    story = Story(hello(1))
    story.step(1, Created())
    story.start(2, "w-0", "n0")
    before = story.job.model_dump()
    assert story.start(3, "w-0", "n0") == []
    assert story.job.model_dump() == before


def test_a_grant_of_another_machine_for_a_placed_worker_gives_that_room_back() -> None:
    story = Story(hello(1))
    story.step(1, Created())
    story.start(2, "w-0", "n0")
    before = story.job.model_dump()
    assert story.start(3, "w-0", "n1") == [Release(task_id="w-0", attempt=0)]
    assert story.job.model_dump() == before


def test_a_repeated_waiting_reason_is_recorded_once() -> None:
    story = Story(hello(1))
    story.step(1, Created())
    waiting = PlacementUpdate(
        task_id="w-0", attempt=0, reason=Reason("NoMachineFits", "No machine fits: 0 of 1 machines ready")
    )
    story.step(2, waiting)
    story.step(3, waiting)
    assert story.history("w-0") == [
        ("Pending", "Waiting for workers to start"),
        ("Pending", "No machine fits: 0 of 1 machines ready"),
    ]
    assert [entry.at for entry in story.job.task("w-0").history] == [at(1), at(2)]


# ---- bugs found and fixed ----------------------------------------------------------------------------------


def test_a_cancelled_run_stays_cancelled_when_a_backoff_timer_fires() -> None:
    story = running_story(2)
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(11, CancelRequested())
    story.step(12, TaskEnded(task_id="w-1", attempt=0, exit_code=143))
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")


def test_stopping_a_worker_in_backoff_does_not_fail_the_run() -> None:
    story = running_story(2)
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(11, StopRequested(task_id="w-0"))
    assert story.status() == ("Running", "1 of 2 workers running")


def test_a_failed_runs_reason_does_not_change_after_it_ended() -> None:
    spec = parse_spec(
        {
            "name": "hello",
            "groups": [
                {"name": "a", "command": ["x"], "restart_policy": "Never"},
                {"name": "b", "command": ["x"]},
                {"name": "c", "command": ["x"]},
            ],
        }
    )
    story = Story(spec)
    ids = ["a-0", "b-0", "c-0"]
    story.step(1, Created())
    story.step(2, *[PlacementUpdate(task_id=t, attempt=0, node=f"n{i}") for i, t in enumerate(ids)])
    story.step(3, *[TaskStarted(task_id=t, attempt=0) for t in ids])
    story.step(4, *[TaskRunning(task_id=t, attempt=0) for t in ids])
    story.step(5, TaskEnded(task_id="b-0", attempt=0, exit_code=1))
    story.step(6, TaskEnded(task_id="a-0", attempt=0, exit_code=3))
    assert story.status() == ("Failed", "Worker a-0 failed on n0: Exited with code 3")
    story.step(7, TaskEnded(task_id="c-0", attempt=0, exit_code=143))
    assert story.run_history()[-2:] == [
        ("Running", "2 of 3 workers running"),
        ("Failed", "Worker a-0 failed on n0: Exited with code 3"),
    ]


def test_a_run_whose_worker_ends_before_its_running_report_passes_through_running() -> None:
    story = Story(hello(1))
    story.step(1, Created())
    story.start(2, "w-0", "n0")
    story.step(3, TaskStarted(task_id="w-0", attempt=0))
    story.step(4, TaskEnded(task_id="w-0", attempt=0, exit_code=0))
    assert story.run_history()[-2:] == [("Running", "1 of 1 workers running"), ("Completed", "All workers completed")]
    assert story.job.status.started_at == at(4)
    assert story.job.task("w-0").status.started_at == at(4)


# ---- protocol 2: one activity starts and watches a worker ---------------------------------------------------------


def protocol_2_story(policy: str = "OnFailure") -> Story:
    story = Story(hello(1, policy))
    story.job.protocol = 2
    story.step(1, Created())
    story.step(2, PlacementUpdate(task_id="w-0", attempt=0, node="n0"))
    return story


def test_one_report_says_a_worker_was_started_and_runs() -> None:
    story = protocol_2_story()
    story.step(3, TaskRunning(task_id="w-0", attempt=0, started=True))
    assert story.history("w-0")[-3:] == [
        ("Preparing", "Placed on n0"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
    ]
    assert story.run_history()[-1] == ("Running", "1 of 1 workers running")


def test_a_first_attempt_running_arms_no_reset_timer_and_a_restarted_one_does() -> None:
    story = protocol_2_story()
    story.step(3, TaskRunning(task_id="w-0", attempt=0, started=True))
    assert story.resets == []  # a count of 0 has nothing to reset
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    story.start(21, "w-0", "n0", attempt=1)
    story.step(22, TaskRunning(task_id="w-0", attempt=1, started=True))
    assert story.resets == [ArmTimer(timer=Timer.RESET, task_id="w-0", attempt=1, at=at(622))]


# ---- a worker lost with its machine that had exited 0 meanwhile (issue 11, finding 8) --------------------------


def test_a_worker_lost_with_its_machine_that_had_exited_0_completes_when_the_machine_says_so_and_is_not_run_again() -> (
    None
):
    story = running_story(1)
    assert story.step(10, MachineLost(node="n0")) == [
        Release(task_id="w-0", attempt=0),
        ArmTimer(timer=Timer.RESTART, task_id="w-0", attempt=0, at=at(20)),
    ]
    assert story.step(12, ExitedWhileLost(task_id="w-0", attempt=0, node="n0")) == []
    task = story.job.task("w-0")
    assert (task.state, task.final, task.restart_at, task.last_failure) == ("Completed", True, None, None)
    assert story.history("w-0")[-2:] == [
        ("Down", "Machine lost: its lease expired"),
        ("Completed", "Exited with code 0"),
    ]
    assert story.status() == ("Completed", "All workers completed")
    assert story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0)) == []  # its restart is off
    assert story.job.task("w-0").attempt.number == 0


@pytest.mark.parametrize(
    ("story", "report"),
    [
        (running_story(1), ExitedWhileLost(task_id="w-0", attempt=0, node="n1")),
        (running_story(1), ExitedWhileLost(task_id="w-0", attempt=1, node="n0")),
        (running_story(1, policy="Always"), ExitedWhileLost(task_id="w-0", attempt=0, node="n0")),
        (running_story(1, policy="Never"), ExitedWhileLost(task_id="w-0", attempt=0, node="n0")),
    ],
    ids=["another machine says so", "about another attempt", "restart policy Always", "restart policy Never"],
)
def test_a_late_exit_changes_nothing_unless_it_is_the_lost_attempt_on_its_machine_waiting_to_run_again(
    story: Story, report: ExitedWhileLost
) -> None:
    story.step(10, MachineLost(node="n0"))
    before = story.job
    assert story.step(12, report) == []
    assert story.job.task("w-0") == before.task("w-0")


def test_a_late_exit_of_a_worker_already_running_again_changes_nothing() -> None:
    story = running_story(1)
    story.step(10, MachineLost(node="n0"))
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    before = story.job
    assert story.step(21, ExitedWhileLost(task_id="w-0", attempt=0, node="n0")) == []
    assert story.job.task("w-0") == before.task("w-0")


# ---- a late report of a machine loss that came before the worker's start (chaos run-0019) -----------------------


def test_a_loss_reported_after_a_new_agent_started_the_worker_leaves_it_running() -> None:
    """The machine was lost at 2.5 s, came back and its new agent started w-0 (reported at 3 s); the report of the
    loss reaches the run only at 4 s: it is about an agent that is gone, not this attempt."""
    story = protocol_2_story()
    story.step(3, TaskRunning(task_id="w-0", attempt=0, started=True))
    assert story.step(4, MachineLost(node="n0", lost_at=at(2.5))) == []
    assert story.status("w-0") == ("Running", "Container running")
    assert story.status() == ("Running", "1 of 1 workers running")
    assert story.job.task("w-0").last_failure is None


def test_a_start_and_an_earlier_loss_decided_together_leave_the_worker_running() -> None:
    story = protocol_2_story()
    story.step(4, TaskRunning(task_id="w-0", attempt=0, started=True), MachineLost(node="n0", lost_at=at(3)))
    assert story.status("w-0") == ("Running", "Container running")


@pytest.mark.parametrize(
    "lost_at",
    [None, at(3.5), at(10)],
    ids=["the report does not say when", "lost after the start", "lost after it went running"],
)
def test_a_loss_after_the_start_or_undated_still_takes_the_worker_down(lost_at: datetime | None) -> None:
    story = running_story(1)  # started at 3 s, running at 4 s
    assert story.step(10, MachineLost(node="n0", lost_at=lost_at)) == [
        Release(task_id="w-0", attempt=0),
        ArmTimer(timer=Timer.RESTART, task_id="w-0", attempt=0, at=at(20)),
    ]
    assert story.status("w-0") == ("Down", "Machine lost: its lease expired")


def test_a_worker_started_by_the_machines_old_agent_is_lost_even_if_it_went_running_after_the_loss() -> None:
    """Protocol 1: started at 3 s, its supervisor's report of it running at 4 s; lost at 3.5 s."""
    story = running_story(1)
    story.step(10, MachineLost(node="n0", lost_at=at(3.5)))
    assert story.status("w-0") == ("Down", "Machine lost: its lease expired")


def test_a_worker_started_at_the_moment_of_the_loss_is_the_new_agents() -> None:
    story = running_story(1)  # started at 3 s
    assert story.step(10, MachineLost(node="n0", lost_at=at(3))) == []
    assert story.status("w-0") == ("Running", "Container running")


@pytest.mark.parametrize("lost_at", [None, at(1), at(2.5)], ids=["no time", "lost before its placement", "lost since"])
def test_a_worker_placed_but_not_started_yet_is_lost_whenever_the_loss_was(lost_at: datetime | None) -> None:
    story = protocol_2_story()  # placed on n0 at 2 s: Preparing
    story.step(4, MachineLost(node="n0", lost_at=lost_at))
    assert story.status("w-0") == ("Down", "Machine lost: its lease expired")


def test_an_earlier_attempts_start_does_not_shield_an_attempt_not_started_yet() -> None:
    """Attempt 0 started at 3 s and was lost; attempt 1 is placed on n0 again, not started: a loss it hears of
    is about it, even one dated after attempt 0's start."""
    story = running_story(1)
    story.step(10, MachineLost(node="n0"))
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    story.start(21, "w-0", "n0", attempt=1)
    story.step(22, MachineLost(node="n0", lost_at=at(5)))
    assert story.status("w-0") == ("Down", "Machine lost: its lease expired")
    assert story.job.task("w-0").attempt.number == 1


def test_a_restarted_attempt_started_after_a_second_loss_keeps_running_when_that_loss_is_reported_late() -> None:
    story = running_story(1)
    story.step(10, MachineLost(node="n0"))
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    story.start(21, "w-0", "n0", attempt=1)
    story.step(23, TaskStarted(task_id="w-0", attempt=1), TaskRunning(task_id="w-0", attempt=1))
    assert story.step(24, MachineLost(node="n0", lost_at=at(22))) == []
    assert story.status("w-0") == ("Running", "Container running")


def test_a_worker_stopping_that_a_new_agent_started_is_not_counted_lost_while_stopping() -> None:
    story = protocol_2_story()
    story.step(3, TaskRunning(task_id="w-0", attempt=0, started=True))
    story.step(4, StopRequested(task_id="w-0"))
    assert story.step(5, MachineLost(node="n0", lost_at=at(2.5))) == []
    assert story.status("w-0")[0] == "Stopping"


def test_a_long_history_folded_past_the_start_still_knows_when_the_worker_went_running() -> None:
    story = running_story(1, settings=Settings(history_keep=10))  # started at 3 s, running at 4 s
    for second in range(5, 25, 2):
        story.step(second, HeartbeatLate(task_id="w-0", attempt=0))
        story.step(second + 1, TaskRunning(task_id="w-0", attempt=0, heartbeat=True))
    assert story.job.task("w-0").summarised > 0
    assert story.step(30, MachineLost(node="n0", lost_at=at(3.5))) == []
    assert story.step(31, MachineLost(node="n0", lost_at=at(4.5))) != []
    assert story.status("w-0") == ("Down", "Machine lost: its lease expired")


def test_a_first_placement_is_taken_by_a_place_that_asks_only_what_was_asked_and_the_rest_given_back() -> None:
    job = new_job(hello(3), Settings(), T0)
    asked = first_requests(job.spec, Settings(), PROTOCOL, T0)
    answers = [PlacementUpdate(task_id=r.task_id, attempt=r.attempt, node="n0") for r in asked]
    first = FirstPlacement.of(asked, answers)
    assert first.take(Place(requests=[asked[0].model_copy(update={"waiting_since": at(1)})])) is None  # not as asked
    assert first.take(Place(requests=[asked[0], asked[1]])) == answers[:2]
    assert first.take(Place(requests=[asked[1]])) is None  # taken already
    assert first.unasked() == [Release(task_id="w-2", attempt=0)]
    assert first.unasked() == []
    assert first.take(Place(requests=[asked[2]])) is None
