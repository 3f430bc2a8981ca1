"""DrivesWorkflow (id `drives`): the cluster's catalogue of drives, durable. `astraeus drive create|rm` are its
updates, and machines report through it whether they could fill their copies; each change is handed to the
scheduler (`drives_changed`), which also reads the catalogue back (`drives` query) when it rebuilds. A drive that a
run's workers wait for or hold is not removed (the scheduler knows them: `drive_users`)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import SCHEDULER_TASK_QUEUE
    from workflows.domain.constraints import Drive
    from workflows.domain.drives import DriveReport, NewDrive, in_use_refusal, reported
    from workflows.messages import DrivesChangedInput, DrivesInput, RemoveDriveRequest


@workflow.defn(name=contracts.DRIVES_WORKFLOW)
class DrivesWorkflow:
    @workflow.init
    def __init__(self, input: DrivesInput) -> None:
        self._drives: dict[str, Drive] = {d.name: d for d in input.drives}
        self._changes = 0  # changes made; the scheduler is told after each one
        self._told = 0
        # One removal at a time: between asking the scheduler who uses a drive and removing it, nothing else changes.
        self._lock = asyncio.Lock()

    @workflow.run
    async def run(self, input: DrivesInput) -> None:
        while True:
            await workflow.wait_condition(
                lambda: self._changes != self._told or workflow.info().is_continue_as_new_suggested()
            )
            if self._changes == self._told:
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(DrivesInput(drives=self._list()))
            self._told = self._changes
            await workflow.execute_activity(
                contracts.drives_changed,
                DrivesChangedInput(drives=self._list()),
                task_queue=SCHEDULER_TASK_QUEUE,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=contracts.PATIENT,
                summary="tell the scheduler",
            )

    def _list(self) -> list[Drive]:
        return [self._drives[name] for name in sorted(self._drives)]

    @workflow.update(name=contracts.CREATE_DRIVE.name)
    def create_drive(self, new: NewDrive) -> list[Drive]:
        self._drives[new.name] = new.drive()
        self._changes += 1
        return self._list()

    @create_drive.validator
    def _validate_create(self, new: NewDrive) -> None:
        if new.name in self._drives:
            raise ApplicationError(f"drive {new.name} exists: remove it first (astraeus drive rm {new.name})")

    @workflow.update(name=contracts.REMOVE_DRIVE.name)
    async def remove_drive(self, request: RemoveDriveRequest) -> list[Drive]:
        async with self._lock:
            if request.name not in self._drives:
                raise ApplicationError(f"no drive named {request.name}", type="NoDrive")
            users = await workflow.execute_activity(
                contracts.drive_users,
                request,
                task_queue=SCHEDULER_TASK_QUEUE,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=contracts.PATIENT,
                summary="who uses it",
            )
            if users.runs:
                raise ApplicationError(in_use_refusal(request.name, users.runs), type="DriveInUse")
            del self._drives[request.name]
            self._changes += 1
            return self._list()

    @remove_drive.validator
    def _validate_remove(self, request: RemoveDriveRequest) -> None:
        if request.name not in self._drives:
            raise ApplicationError(f"no drive named {request.name}", type="NoDrive")

    @workflow.update(name=contracts.REPORT_DRIVE.name)
    def report_drive(self, report: DriveReport) -> list[Drive]:
        """A machine could fill its copy, or could not (why): a problem keeps new workers off the drive."""
        drive = self._drives.get(report.drive)
        if drive is not None:
            after = reported(drive, report)
            if after != drive:
                self._drives[report.drive] = after
                self._changes += 1
        return self._list()

    @workflow.query(name=contracts.DRIVES.name)
    def drives(self) -> list[Drive]:
        return self._list()
