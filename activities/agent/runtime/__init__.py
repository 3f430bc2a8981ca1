"""Runtimes run a worker's container or process on a machine: `docker` and `process`."""
