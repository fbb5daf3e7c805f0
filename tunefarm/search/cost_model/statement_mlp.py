"""A small neural network over a program's statements: the contender to the pretrained
pack-sum trees (TenSet's MLP cost model).

    score(P) = sum over P's stores s of  mlp(standardise(features(s) ++ descriptor))

the same pack-sum over the same per-store rows the trees see (`pretrain.stack_rows`: the
Ansor features of each innermost store with the class's device descriptor appended), so
the two differ only in the function of a row: a few fully connected ReLU layers instead
of boosted trees. It is trained with the pairwise ranking loss of `ranking.py` on the
same pairs (one task of one class at a time, beyond the measurement noise, weighted by
the throughput gap), full batch with Adam and weight decay, for a fixed number of epochs.

`tunefarm pretrain --compare` trains it beside the trees' objectives on the same split
and scores it on the same held-out workloads (`pretrain.ranking_report`), so that the
better model is the one kept. Training needs PyTorch (`pip install 'tunefarm[torch]'`);
scoring is plain numpy (`StatementMLP.scores`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tunefarm.errors import UsageError

from .pretrain import DatasetError, TrainingPrograms, stack_rows, task_labels, task_pairs
from .xgb import pack_sum


@dataclass(frozen=True)
class MLPConfig:
    # Chosen on five held-out fifths of the workloads of one class's dataset: 400 epochs
    # of a 3x256 network fit the training pairs almost perfectly and ranked held-out
    # workloads worse (pairwise 0.658) than 150 epochs of 2x128 with more decay (0.699).
    hidden: int = 128
    layers: int = 2  # hidden layers
    epochs: int = 150
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    max_pairs: int = 4096  # pairs drawn per group at most, as the trees' rank objective
    seed: int = 43
    threads: int = 1


@dataclass(frozen=True, eq=False)
class StatementMLP:
    """A trained network: per-column standardisation, then (weight, bias) per layer."""

    mean: np.ndarray  # (F + D,) float32
    scale: np.ndarray  # (F + D,) float32: 1 / std, 0 for a constant column
    layers: tuple[tuple[np.ndarray, np.ndarray], ...]  # (in, out) weight, (out,) bias
    train_loss: float
    epochs: int
    seconds: float

    def row_values(self, rows: np.ndarray) -> np.ndarray:
        x = (rows.astype(np.float32) - self.mean) * self.scale
        for k, (w, b) in enumerate(self.layers):
            x = x @ w + b
            if k < len(self.layers) - 1:
                np.maximum(x, 0.0, out=x)
        return x[:, 0]

    def scores(self, programs: TrainingPrograms) -> np.ndarray:
        """Each program's score, with the descriptor of its own class."""
        data = stack_rows(programs)
        return pack_sum(self.row_values(data.rows).astype(np.float64), data.row_program, len(programs))


def train_statement_mlp(programs: TrainingPrograms, config: MLPConfig = MLPConfig()) -> StatementMLP:
    """The network trained on `programs` (module doc). Raises UsageError without PyTorch,
    DatasetError without a pair to rank."""
    try:
        import torch
    except ImportError:
        raise UsageError("the statement MLP trains with PyTorch: pip install 'tunefarm[torch]'") from None
    if not len(programs):
        raise DatasetError("no program to train on")
    start = time.perf_counter()
    group_ids, y = task_labels(programs)
    pairs = task_pairs(programs, group_ids, y, max_pairs=config.max_pairs, seed=config.seed)
    data = stack_rows(programs)
    mean = data.rows.mean(axis=0).astype(np.float32)
    std = data.rows.std(axis=0).astype(np.float32)
    scale = np.where(std > 1e-6, 1.0 / np.maximum(std, 1e-6), 0.0).astype(np.float32)

    torch.set_num_threads(config.threads)
    generator = torch.Generator().manual_seed(config.seed)
    sizes = [data.rows.shape[1]] + [config.hidden] * config.layers + [1]
    linears = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        bound = (6.0 / fan_in) ** 0.5  # He uniform: ReLU layers keep their variance
        w = (torch.rand(fan_in, fan_out, generator=generator) * 2 - 1) * bound
        linears.append((w.requires_grad_(), torch.zeros(fan_out, requires_grad=True)))
    params = [p for layer in linears for p in layer]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)

    x = torch.from_numpy((data.rows - mean) * scale)
    row_program = torch.from_numpy(data.row_program)
    better, worse = torch.from_numpy(pairs.better), torch.from_numpy(pairs.worse)
    weight = torch.from_numpy(pairs.weight / pairs.weight.sum()).float()
    n = len(programs)

    def loss_of() -> torch.Tensor:
        h = x
        for k, (w, b) in enumerate(linears):
            h = h @ w + b
            if k < len(linears) - 1:
                h = torch.relu(h)
        scores = torch.zeros(n).index_add(0, row_program, h[:, 0])
        return torch.sum(weight * torch.nn.functional.softplus(-(scores[better] - scores[worse])))

    loss = loss_of()
    for _ in range(config.epochs):
        optimizer.zero_grad()
        loss = loss_of()
        loss.backward()
        optimizer.step()
    layers = tuple((w.detach().numpy().copy(), b.detach().numpy().copy()) for w, b in linears)
    return StatementMLP(mean, scale, layers, float(loss.detach()), config.epochs, time.perf_counter() - start)
