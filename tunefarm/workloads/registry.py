"""Built-in workloads with shape parameters (filled in below)."""
from __future__ import annotations

OPS: dict = {}


def make(name, params):
    raise NotImplementedError
