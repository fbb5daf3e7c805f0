"""The cost-model interface the search scores candidate programs with (Ansor paper §5.2).

A program is described by a float32 feature matrix of shape ``(n_stores, F)``: one row per
innermost store statement, ``F`` fixed for one model. A 0-row matrix means the program is
invalid (its features could not be extracted, e.g. lowering failed).

Programs belong to groups (one group = one tuning task): costs are only comparable within a
group, so every measurement carries its group name.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Self

import numpy as np

INVALID_SCORE = -np.inf
"""Score `predict` gives a program with no feature rows (an invalid program)."""


class CostModel(ABC):
    """Scores programs; a higher score means the program is predicted to run faster."""

    learns_from_updates: bool = True
    """False for a model that learns elsewhere (the farm's class model learns from
    Postgres): `update` then does nothing, and no features are computed to call it."""

    @abstractmethod
    def update(
        self, features: Sequence[np.ndarray], costs: Sequence[float], groups: Sequence[str], *, train: bool = True
    ) -> None:
        """Add the programs of one measured batch; called after every measured batch.

        Pass only the new measurements: the model keeps its own history of everything it has
        seen. ``costs`` are in seconds, ``math.inf`` for a failed measurement; ``groups`` name
        the tuning task of each program. The three sequences have one entry per program.
        ``train`` False only adds them to the history: a later update with ``train`` True
        learns them too (the caller paces retraining).
        """

    @abstractmethod
    def predict(self, features: Sequence[np.ndarray]) -> np.ndarray:
        """Score many programs at once; called by the evolutionary search on each population.

        Returns a float64 array with one score per program, higher = predicted faster.
        Programs with a 0-row feature matrix get `INVALID_SCORE` (-inf).
        """

    @abstractmethod
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model and the history it needs to continue to the single file ``path``.

        Called when a tuning job checkpoints or ends.
        """

    @classmethod
    @abstractmethod
    def load(cls, path: str | os.PathLike[str]) -> Self:
        """Build a model from a file written by ``save`` of the same class.

        A classmethod, because the file holds everything (configuration included). The loaded
        model predicts exactly what the saved one did and accepts further ``update`` calls.
        """

    @property
    @abstractmethod
    def num_samples(self) -> int:
        """Number of programs passed to ``update`` so far (failed and invalid ones included)."""

    @property
    def ranks(self) -> bool:
        """Whether its scores rank programs (trained trees, or a pretrained base), so that
        the search evolves a population by them; False: its scores are random, and a batch
        is drawn at random instead."""
        return False


def program_row_counts(features: Sequence[np.ndarray]) -> np.ndarray:
    """Number of feature rows of each program (0 for an invalid program), as int64."""
    return np.fromiter((_num_rows(f) for f in features), dtype=np.int64, count=len(features))


def _num_rows(matrix: np.ndarray) -> int:
    shape = np.shape(matrix)
    return int(shape[0]) if shape and np.size(matrix) else 0


def check_update_args(
    features: Sequence[np.ndarray], costs: Sequence[float], groups: Sequence[str]
) -> np.ndarray:
    """Validate the arguments of `CostModel.update`; returns the costs as a float64 array."""
    if not len(features) == len(costs) == len(groups):
        raise ValueError(
            f"update() needs one cost and one group per program, got {len(features)} programs, "
            f"{len(costs)} costs and {len(groups)} groups"
        )
    cost_array = np.asarray(costs, dtype=np.float64).reshape(len(costs))
    if np.isnan(cost_array).any() or (cost_array <= 0).any():
        raise ValueError("costs must be positive seconds, or math.inf for a failed measurement")
    return cost_array
