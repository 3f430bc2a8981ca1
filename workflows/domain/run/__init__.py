"""The run's decisions, pure: JobWorkflow's core (`job.decide`), its record, events and effects."""
