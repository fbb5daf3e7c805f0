"""Cost models that score candidate programs for the search (Ansor paper §5.2).

`CostModel` is the interface; `RandomCostModel` is the seeded stand-in, `XGBCostModel` the
learned pack-sum model. `metrics` measures how well scores rank measured programs.
"""

from .base import INVALID_SCORE, CostModel
from .metrics import pairwise_accuracy, recall_at_k
from .random_model import RandomCostModel
from .xgb import TrainingStats, XGBConfig, XGBCostModel

__all__ = [
    "INVALID_SCORE",
    "CostModel",
    "RandomCostModel",
    "TrainingStats",
    "XGBConfig",
    "XGBCostModel",
    "pairwise_accuracy",
    "recall_at_k",
]
