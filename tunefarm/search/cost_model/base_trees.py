"""Pretrained trees a cost model's own trees are trained on top of (a "base").

A base is an XGBoost ensemble trained across many tasks and device classes (`pretrain`)
on feature rows with the device descriptor of their class appended
(`tunefarm.search.cost_model.descriptor`). A model that carries one
(`XGBCostModel(base=...)`) scores a program as

    score(P) = sum over P's rows r of  base(r ++ descriptor) + own(r)

where `descriptor` is the model's own device's: before its own trees exist it ranks
with the base alone, and its own trees are trained on the residual (XGBoost's
`base_margin` is each row's base value, so the pack-sum objective sees base + own), so
the device's own measurements take over wherever they disagree with the base.

A base trained with a ranking objective has no scale of its own (only differences
within a task count), while the search breeds programs with probability proportional
to their score and the own trees fit normalised throughputs: `scale` and `offset` map
its program scores onto the label scale (one affine map, fitted on its training
programs: `score = scale * sum of row values + offset`, the offset shared out over a
program's rows). A squared-error base has scale 1, offset 0.

`info` says what it was trained on (the pretrained file's metadata).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xgboost as xgb

from tunefarm.search.cost_model.descriptor import DESCRIPTOR_VERSION, DESCRIPTOR_WIDTH


@dataclass(frozen=True, eq=False)
class BaseTrees:
    """A pretrained ensemble and the descriptor of the device it scores for (module doc)."""

    booster: xgb.Booster
    descriptor: np.ndarray  # (DESCRIPTOR_WIDTH,) float32: the device the model's programs run on
    scale: float = 1.0
    offset: float = 0.0
    descriptor_version: int = DESCRIPTOR_VERSION
    info: Mapping[str, Any] = field(default_factory=dict)

    def with_descriptor(self, descriptor: np.ndarray) -> BaseTrees:
        """The same trees scoring for another device."""
        return replace(self, descriptor=np.asarray(descriptor, dtype=np.float32).reshape(-1))

    def row_values(self, rows: np.ndarray, row_program: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Each row's share of its program's base score (float32): the trees' value of
        the row with the descriptor appended, scaled, plus the program's offset over its
        rows. `row_program`: each row's program index into `counts` (rows per program)."""
        if not rows.shape[0]:
            return np.zeros(0, dtype=np.float32)
        return row_values(self.booster, with_descriptor(rows, self.descriptor), row_program, counts,
                          self.scale, self.offset)  # fmt: skip

    def state(self) -> dict[str, Any]:
        """Everything but the trees, JSON-serialisable (for saving)."""
        return {
            "descriptor": [float(x) for x in self.descriptor],
            "descriptor_version": self.descriptor_version,
            "scale": self.scale,
            "offset": self.offset,
            "info": dict(self.info),
        }

    def tree_bytes(self) -> np.ndarray:
        return np.frombuffer(self.booster.save_raw("ubj"), np.uint8)

    @staticmethod
    def from_saved(state: Mapping[str, Any], trees: np.ndarray, nthread: int) -> BaseTrees:
        booster = xgb.Booster(model_file=bytearray(trees.tobytes()))
        booster.set_param({"nthread": nthread})
        return BaseTrees(
            booster=booster,
            descriptor=np.asarray(state["descriptor"], dtype=np.float32),
            scale=float(state.get("scale", 1.0)),
            offset=float(state.get("offset", 0.0)),
            descriptor_version=int(state.get("descriptor_version", -1)),
            info=dict(state.get("info") or {}),
        )

    def incompatibility(self) -> str | None:
        """Why these trees cannot score with this version's descriptors, or None."""
        if self.descriptor_version != DESCRIPTOR_VERSION or len(self.descriptor) != DESCRIPTOR_WIDTH:
            return (
                f"built for device descriptor version {self.descriptor_version} ({len(self.descriptor)} wide), "
                f"not {DESCRIPTOR_VERSION} ({DESCRIPTOR_WIDTH} wide)"
            )
        return None

    def describe(self) -> str:
        return json.dumps({k: self.info[k] for k in ("objective", "programs", "tasks") if k in self.info})


def with_descriptor(rows: np.ndarray, descriptor: np.ndarray) -> np.ndarray:
    """`rows` (R, F) with the descriptor (D,) appended to each: (R, F + D) float32."""
    d = np.asarray(descriptor, dtype=np.float32).reshape(1, -1)
    return np.concatenate([rows.astype(np.float32, copy=False), np.broadcast_to(d, (rows.shape[0], d.shape[1]))],
                          axis=1)  # fmt: skip


def row_values(
    booster: xgb.Booster, rows: np.ndarray, row_program: np.ndarray, counts: np.ndarray, scale: float, offset: float
) -> np.ndarray:
    """scale * booster(row) + offset / (rows of the row's program), per row (float32)."""
    raw = booster.inplace_predict(rows).astype(np.float64)
    if offset:
        raw = scale * raw + offset / np.maximum(counts[row_program], 1)
    elif scale != 1.0:
        raw = scale * raw
    return raw.astype(np.float32)
