"""The cyclic garbage collector, paused while the search proposes a batch.

A round of the evolution builds thousands of loop-nest models (about a hundred small
objects each) that live for a generation or the round. Each young-generation collection
finds them alive and promotes them, and the promotions trigger full collections, which
walk every object of the process: in a tuning process, which has TVM, torch and XGBoost
loaded, about half a second each, about once per round. Measured on a 64-trial tune of
the demo model: 15 full collections, 7 s of the main process, whose search took 27 s
(paused: 1.5 s of collection in all). The models hold no reference cycles, so reference
counting frees them when the round drops them; paused, the collector promotes nothing
and so walks the old objects no more for it. What little cyclic garbage a round makes
waits until the collector runs again after it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (as it was again after it)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
