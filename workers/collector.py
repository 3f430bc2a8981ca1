"""The garbage collector's settings for Astraeus's long-running processes (control plane, scheduler, agent, API,
`astraeus dev`)."""

from __future__ import annotations

import functools
import gc

# CPython's default collector looks at the young objects every 700 allocations and at the whole heap every so often.
# In a burst of 500 runs (bench/README.md) it ran 400 times in the control plane's process, 3 of them over the whole
# heap: 0.7 s of CPU, and a longest pause of 0.23 to 0.27 s, every workflow task and the event loop stopped
# meanwhile. What a process made while starting (modules, the SDK, the schemas) lives as long as it does: frozen, no
# collection looks at it again. A young collection every 10,000 allocations lets a burst's short-lived objects die
# before one: 28 collections in that burst, none of the whole heap, 0.18 to 0.25 s, a longest pause of 0.04 to 0.14
# s. Cycles are still collected, only less often.
YOUNG_THRESHOLD = 10_000


@functools.cache
def tune() -> None:
    """Freeze what the process holds at its start and collect young objects less often. Only the first call
    counts: later ones (a test that runs several services in one process) freeze nothing more."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
