"""Workloads: what gets tuned.

A `Workload` is one tensor computation as a TVM PrimFunc (inputs first, outputs last),
with its FLOP count and, where known, a numpy reference. It comes from

- the built-in registry (`registry.py`): `matmul`, `conv2d`, `softmax`, ... with shape
  parameters (`--shape M=1024,N=1024,K=1024`);
- a user's Python file, `file.py:function`, where the function returns TE tensors
  (inputs first, outputs last);
- a user's TVMScript file holding one `@T.prim_func`.

Nothing in the search engine looks at a workload's name.
"""

from tunefarm.workloads.base import Workload, workload_from_prim_func, workload_from_te
from tunefarm.workloads.loader import load_workload

__all__ = ["Workload", "load_workload", "workload_from_prim_func", "workload_from_te"]
