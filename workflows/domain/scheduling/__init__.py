"""The scheduler's pass, pure: which waiting worker goes where, or why it waits (`queue.schedule`)."""
