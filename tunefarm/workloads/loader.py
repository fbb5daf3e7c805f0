"""Turn what the user typed (`matmul`, `ops.py:conv`, `kernel.py`) into a `Workload`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tunefarm.errors import UsageError, WorkloadError
from tunefarm.workloads.base import Workload, workload_from_prim_func, workload_from_te


def parse_shape(text: str | None) -> dict[str, int]:
    """`"M=1024,N=512"` -> {"M": 1024, "N": 512}."""
    if not text:
        return {}
    out: dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--shape: expected NAME=INT pairs separated by commas, got {part!r}")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            raise UsageError(f"--shape: {name.strip()} must be an integer, got {value.strip()!r}") from None
    return out


def load_workload(spec: str, shape: str | None = None) -> Workload:
    """A registry name, `file.py:function` (TE tensors) or `file.py` (TVMScript PrimFunc)."""
    from tunefarm.workloads import registry

    params = parse_shape(shape)
    if spec in registry.OPS:
        return registry.make(spec, params)
    path_text, sep, func_name = spec.partition(":")
    if path_text.endswith(".py"):
        path = Path(path_text)
        if not path.is_file():
            raise WorkloadError(f"no such file: {path_text}")
        module = _import_file(path)
        if sep:
            return _from_te_function(module, path, func_name, params)
        if params:
            raise UsageError("--shape applies to registry workloads and file.py:function, not to a TVMScript file")
        return _from_tvmscript_module(module, path)
    known = ", ".join(sorted(registry.OPS))
    raise UsageError(f"unknown workload {spec!r}: use one of {known}, file.py:function or a TVMScript file.py")


def _import_file(path: Path):
    name = f"tunefarm_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise WorkloadError(f"importing {path} failed: {type(exc).__name__}: {_first_line(exc)}") from None
    return module


def _from_te_function(module, path: Path, func_name: str, params: dict[str, int]) -> Workload:
    import inspect

    import tvm

    fn = getattr(module, func_name, None)
    if isinstance(fn, tvm.tirx.PrimFunc):
        if params:
            raise UsageError("--shape applies to functions returning TE tensors, not to a @T.prim_func")
        return workload_from_prim_func(f"{path.name}:{func_name}", fn)
    if fn is None or not callable(fn):
        raise WorkloadError(f"{path} has no function {func_name!r}")
    try:
        bound = inspect.signature(fn).bind(**params)
    except TypeError as exc:
        raise WorkloadError(f"calling {path.name}:{func_name}({_kwargs(params)}) failed: {_first_line(exc)}") from None
    bound.apply_defaults()
    try:
        tensors = fn(*bound.args, **bound.kwargs)
    except Exception as exc:
        raise WorkloadError(f"{path.name}:{func_name} raised {type(exc).__name__}: {_first_line(exc)}") from None
    # Name from the bound arguments (defaults included, signature order): the same
    # workload gets the same name whatever order --shape was typed in.
    shown = {k: v for k, v in bound.arguments.items() if isinstance(v, int)}
    name = f"{path.name}:{func_name}" + (f"({_kwargs(shown)})" if shown else "")
    if not isinstance(tensors, (list, tuple)):
        raise WorkloadError(f"{path.name}:{func_name} must return a list of TE tensors (inputs first, outputs last)")
    return workload_from_te(name, tensors)


def _from_tvmscript_module(module, path: Path) -> Workload:
    import tvm

    funcs = []
    for attr, value in vars(module).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, tvm.tirx.PrimFunc):
            funcs.append((attr, value))
        elif isinstance(value, tvm.IRModule):
            prims = [(gv.name_hint, f) for gv, f in value.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
            funcs.extend((f"{attr}.{n}", f) for n, f in prims)
    if not funcs:
        raise WorkloadError(f"{path} defines no @T.prim_func (and no file.py:function was given)")
    if len(funcs) > 1:
        names = ", ".join(n for n, _ in funcs)
        raise WorkloadError(f"{path} defines several PrimFuncs ({names}); keep one per file")
    attr, func = funcs[0]
    return workload_from_prim_func(f"{path.name}:{attr}", func)


def _kwargs(params: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
