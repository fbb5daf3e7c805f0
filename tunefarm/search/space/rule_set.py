"""The search's rule set for a kind of device: the sketch rules, the annotation (how
the loop-nest model fills a sketch's slots), the mutation weights and the feature
layout. Chosen from the target's kind (`rule_set_for`, once per target and process);
nothing else in the search asks what the target is.

- `CpuRules`: Ansor's CPU rules (`sketch.py`) and annotation (parallel, vectorize,
  unroll: `loopnest.py`); the target's vector width steers half the random draws of the
  vectorized tile towards whole vectors.
- `GpuRules`: Ansor's GPU rules (`sketch_gpu.py`) and annotation (thread binding,
  cooperative fetching, unroll: `loopnest_gpu.py`), within the GPU's limits.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tunefarm import target as targets
from tunefarm.errors import TargetError
from tunefarm.gpu import GpuLimits, is_gpu
from tunefarm.isa import target_isa
from tunefarm.search.config import SearchConfig
from tunefarm.search.features import CPU_FEATURE_VERSION, GPU_FEATURE_VERSION
from tunefarm.search.space.dag import ComputeDag
from tunefarm.search.space.loopnest import build
from tunefarm.search.space.program import Program
from tunefarm.search.space.sketch import Sketch, generate_sketches
from tunefarm.search.space.sketch_gpu import generate_gpu_sketches
from tunefarm.search.space.slots import Decider


class RuleSet(ABC):
    """What the search does differently for one kind of device."""

    @property
    @abstractmethod
    def feature_version(self) -> int:
        """The layout of the feature rows its programs get (`features.py`); cost models
        are kept apart by it."""

    @property
    def gpu_limits(self) -> GpuLimits | None:
        """The GPU its programs are for (its features read the SMs); None on a CPU."""
        return None

    @abstractmethod
    def sketches(self, dag: ComputeDag) -> list[Sketch]:
        """Called once per task: the sketches of its DAG."""

    @abstractmethod
    def build(self, dag: ComputeDag, sketch: Sketch, decider: Decider) -> Program:
        """Called for every program the search samples, mutates or rebuilds: the sketch
        applied with `decider`'s slot values. Raises InvalidProgram."""

    @abstractmethod
    def mutation_weights(self, config: SearchConfig) -> dict[str, float]:
        """Called by the evolution: weight of each mutation kind (`slot_kind`)."""


@dataclass(frozen=True)
class CpuRules(RuleSet):
    num_cores: int
    vector_bytes: int = 0  # the target's float vector registers (`TargetISA.vector_bytes`); 0: unknown
    vector_registers: int = 0  # how many (`TargetISA.vector_registers`); 0: unknown

    @property
    def feature_version(self) -> int:
        return CPU_FEATURE_VERSION

    def sketches(self, dag: ComputeDag) -> list[Sketch]:
        return generate_sketches(dag, self.num_cores)

    def build(self, dag: ComputeDag, sketch: Sketch, decider: Decider) -> Program:
        return build(
            dag, sketch, decider, self.num_cores, vector_bytes=self.vector_bytes, vector_registers=self.vector_registers
        )

    def mutation_weights(self, config: SearchConfig) -> dict[str, float]:
        return config.mutation_weights


@dataclass(frozen=True)
class GpuRules(RuleSet):
    gpu: GpuLimits

    @property
    def feature_version(self) -> int:
        return GPU_FEATURE_VERSION

    @property
    def gpu_limits(self) -> GpuLimits | None:
        return self.gpu

    def sketches(self, dag: ComputeDag) -> list[Sketch]:
        return generate_gpu_sketches(dag, self.gpu)

    def build(self, dag: ComputeDag, sketch: Sketch, decider: Decider) -> Program:
        return build(dag, sketch, decider, 1, self.gpu)

    def mutation_weights(self, config: SearchConfig) -> dict[str, float]:
        return config.gpu_mutation_weights


def rule_set_for(target: dict[str, Any]) -> RuleSet:
    """The rule set of a target: GPU rules for a CUDA target, CPU rules otherwise (the
    search's whole view of the target: cores and vector width, or the GPU's limits, and
    the feature version). Worked out once per distinct target in a process (a run asks
    for every task). Raises TargetError for a CUDA target without a usable `arch`."""
    return _rule_set_of(json.dumps(target, sort_keys=True, default=str))


@functools.lru_cache(maxsize=64)
def _rule_set_of(target_json: str) -> RuleSet:
    target = json.loads(target_json)
    if is_gpu(target):
        return GpuRules(GpuLimits.of(target))
    try:
        isa = target_isa(target)
    except TargetError:  # a target TVM rejects fails where it is built, with its own message
        return CpuRules(targets.num_cores(target))
    return CpuRules(targets.num_cores(target), isa.vector_bytes, isa.vector_registers)
