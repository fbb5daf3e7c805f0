"""A cost model that scores programs uniformly at random.

The stand-in for the learned model in tests, and what the learned model answers with before it
has enough data (Ansor's ``RandomModel``; `XGBCostModel` uses one during warm-up). Scores come
from one seeded generator, so a sequence of calls is reproducible for a seed; successive calls
give different scores, which keeps an untrained search exploring.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from .base import INVALID_SCORE, CostModel, check_update_args, program_row_counts

_FORMAT = "tunefarm-random-cost-model/1"


class RandomCostModel(CostModel):
    """Uniform scores in [0, 1); -inf for invalid programs. Ignores what ``update`` tells it."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._num_samples = 0

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def update(
        self, features: Sequence[np.ndarray], costs: Sequence[float], groups: Sequence[str], *, train: bool = True
    ) -> None:
        check_update_args(features, costs, groups)
        self._num_samples += len(features)

    def predict(self, features: Sequence[np.ndarray]) -> np.ndarray:
        # One draw per program, invalid ones included, so the stream does not depend on validity.
        scores = self._rng.uniform(0.0, 1.0, size=len(features))
        scores[program_row_counts(features) == 0] = INVALID_SCORE
        return scores

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the seed, the sample count and the generator state as one JSON file."""
        state = {
            "format": _FORMAT,
            "seed": self._seed,
            "num_samples": self._num_samples,
            "rng_state": self.rng_state(),
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(state, f)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Self:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if state.get("format") != _FORMAT:
            raise ValueError(f"{os.fspath(path)} is not a saved RandomCostModel")
        model = cls(int(state["seed"]))
        model._num_samples = int(state["num_samples"])
        model.set_rng_state(state["rng_state"])
        return model

    def rng_state(self) -> dict[str, Any]:
        """The generator state (JSON-serialisable), for owners that save this model inside theirs."""
        return self._rng.bit_generator.state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        self._rng.bit_generator.state = state
