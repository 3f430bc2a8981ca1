"""Activities of the control plane itself."""

from __future__ import annotations

from temporalio import activity

from workflows.domain.settings import Settings


class ControlActivities:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    @activity.defn(name="load_settings")
    async def load_settings(self) -> Settings:
        """The operator's settings, recorded in each run's history when it starts (so replay sees the same)."""
        return self._settings
