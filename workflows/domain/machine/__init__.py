"""The machine's own decisions, pure: NodeWorkflow's core (`decisions.check`, `decisions.decide_node`)."""
