"""The node agent: one per machine, a Temporal worker on the machine's task queue. It holds the machine's lease,
starts, watches and stops the machine's attempts, and looks after what they leave. `AgentActivities` is its door."""

from activities.agent.facade import AgentActivities

__all__ = ["AgentActivities"]
