"""The TIR pipeline every scheduled CPU kernel and tuned CPU model is compiled with: TVM's
default pipeline, with this project's two rewrites run just before TVM vectorizes loops:
`tunefarm.vector_split` (vectors of whole registers) and `tunefarm.hreduce` (horizontal
reductions). `register()` once per process, then `tvm.compile(..., tir_pipeline=PIPELINE)`.
"""

from __future__ import annotations

import functools

PIPELINE = "tunefarm"
"""The name `tvm.compile(..., tir_pipeline=PIPELINE)` takes once `register()` ran."""

_SPLIT_AT = "tirx.VectorizeLoop"
"""The pass of TVM's default TIR pipeline before which the rewrites run."""

_CONTAINERS = frozenset({"_pipeline", "sequential", "tvm.transform.Sequential"})
"""Passes that only hold others (TVM's pipeline pass and its Sequential): always entered."""


@functools.cache
def register() -> None:
    """Register `PIPELINE` (once per process). TVM's pipeline runs twice, each time with a
    pass instrument that skips one side of `_SPLIT_AT` (its pass list stays TVM's)."""
    import tvm

    from tunefarm import hreduce, vector_split

    default_pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tunefarm.Rewrites")
    def rewrites(func, _mod, _ctx):
        return func.with_body(hreduce.rewrite(vector_split.rewrite(func.body)))

    @tvm.transform.module_pass(opt_level=0, name="tunefarm.TirPipeline")
    def pipeline(mod, _ctx):
        mod = run_part(default_pipeline, mod, before_split=True)
        mod = rewrites(mod)
        return run_part(default_pipeline, mod, before_split=False)

    tvm.tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, lambda: (pipeline, finalize_host, finalize_device))


def run_part(pipeline, mod, *, before_split: bool):
    """`pipeline` on `mod` with only the passes before `_SPLIT_AT` (or only it and those after)."""
    import tvm

    @tvm.instrument.pass_instrument
    class _Half:
        def __init__(self):
            self.reached = False

        def should_run(self, _mod, info):
            if info.name == _SPLIT_AT:
                self.reached = True
            if info.name in _CONTAINERS:
                return True
            return self.reached != before_split

    current = tvm.transform.PassContext.current()
    with tvm.transform.PassContext(opt_level=current.opt_level, config=dict(current.config),
                                   required_pass=list(current.required_pass), disabled_pass=list(current.disabled_pass),
                                   instruments=[*current.instruments, _Half()]):
        return pipeline(mod)
