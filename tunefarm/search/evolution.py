"""Evolutionary search guided by the cost model (Ansor §5.1; SketchPolicy::SearchOneRound).

One round, `EvolutionarySearch.next_batch`:
  1. initial population: fresh random programs plus the best measured ones
     (`use_measured_ratio` of the population) and the programs transferred from similar
     tasks (`similar_programs.py`);
  2. `generations` times: score the population with the cost model, remember the best
     unmeasured programs seen so far, and breed the next population — parents drawn
     with probability proportional to their score, each offspring a mutation
     (`mutation_prob`), a crossover (`crossover_prob`) or a copy;
  3. pick the batch epsilon-greedily: the best-scored unmeasured programs, plus an
     `eps_greedy` share of random unmeasured ones from the initial population (at
     least `min_random_per_batch` in a batch of two or more, `random_picks`).
While the cost model has too little data to be trusted (`model_ready` False), the
evolution is skipped and the batch is random, as Ansor does with its random model
(transferred programs first, up to half of it), drawn from twice the batch's programs
rather than a whole population: ranking nothing, a population only costs its sampling.
Nothing already measured is proposed again.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tunefarm.records import Candidate
from tunefarm.search.collector import collector_paused
from tunefarm.search.config import SearchConfig
from tunefarm.search.cost_model import CostModel
from tunefarm.search.space.program_space import Built, ProgramSpace


@dataclass
class RoundStats:
    sampled: int = 0  # random programs drawn for the initial population
    scored: int = 0  # programs scored by the cost model (with repeats)
    generations: int = 0
    invalid: int = 0  # draws, mutations or crossovers that gave no valid program
    transferred: int = 0  # programs of similar tasks put in the initial population
    seconds: float = 0.0


def _unique(programs: list[Built]) -> list[Built]:
    return list({b.candidate.key: b for b in programs}.values())


def _best_ranked(best: dict[str, tuple[float, Built]], keep: int) -> dict[str, tuple[float, Built]]:
    """The `keep` best-scored entries of `best` (ties: the earlier entry), still in their
    order of entry. Keeps a round from holding every program it scored (thousands, a
    loop-nest model each, which the garbage collector walks again and again) when the
    batch takes the best `2 n` at most: a program dropped here and met again scores the
    same, behind at least `keep` others, so the batch is the one the whole dict gives."""
    if len(best) <= keep:
        return best
    kept = {key for key, _ in sorted(best.items(), key=lambda kv: -kv[1][0])[:keep]}
    return {key: entry for key, entry in best.items() if key in kept}


def random_picks(n: int, cfg: SearchConfig) -> int:
    """Random programs in a batch of `n`: the `eps_greedy` share, at least
    `min_random_per_batch` when the batch has room for a guided pick beside them."""
    share = int(round(cfg.eps_greedy * n))
    return max(share, min(cfg.min_random_per_batch, n - 1))


class EvolutionarySearch:
    def __init__(self, space: ProgramSpace, config: SearchConfig, rng: random.Random):
        self.space = space
        self.config = config
        self.rng = rng

    def next_batch(
        self,
        model: CostModel,
        n: int,
        measured: set[str],
        best_measured: list[Candidate],
        model_ready: bool,
        population: int | None = None,
        transferred: Sequence[Built] = (),
        generations: int | None = None,
    ) -> tuple[list[Built], RoundStats]:
        """Up to `2 n` unmeasured programs, the ones to measure first at the front; the
        caller takes them in order and skips any TVM rejects. `population` and
        `generations` override the configured ones for this round; `transferred` are programs made
        from similar tasks' best, added to the initial population. The garbage collector
        is paused meanwhile (`collector.py`)."""
        with collector_paused():
            return self._next_batch(model, n, measured, best_measured, model_ready, population, transferred, generations)

    def _next_batch(
        self,
        model: CostModel,
        n: int,
        measured: set[str],
        best_measured: list[Candidate],
        model_ready: bool,
        population: int | None,
        transferred: Sequence[Built],
        generations: int | None,
    ) -> tuple[list[Built], RoundStats]:
        t0 = time.perf_counter()
        stats = RoundStats()
        cfg = self.config
        if population is not None:
            cfg = replace(cfg, population=population)
        if generations is not None:
            cfg = replace(cfg, generations=generations)
        invalid_before = self.space.invalid_draws
        n_seed = min(len(best_measured), int(cfg.use_measured_ratio * cfg.population)) if model_ready else 0
        transferred = [b for b in transferred if b.candidate.key not in measured]
        stats.transferred = len(transferred)
        # A random batch needs no population: twice the batch (what the evolution would
        # hand on), more only when most of those draws were measured already.
        wanted = cfg.population - n_seed - len(transferred) if model_ready else min(2 * n, cfg.population)
        fresh = self.space.sample_many(max(wanted, 1), self.rng, cfg.max_invalid_draws)
        unmeasured_fresh = [b for b in fresh if b.candidate.key not in measured]
        if not model_ready and len(unmeasured_fresh) < n and cfg.population > wanted:
            fresh += self.space.sample_many(cfg.population - wanted, self.rng, cfg.max_invalid_draws)
            unmeasured_fresh = [b for b in fresh if b.candidate.key not in measured]
        stats.sampled = len(fresh)
        if not model_ready:
            self.rng.shuffle(unmeasured_fresh)
            stats.invalid = self.space.invalid_draws - invalid_before
            stats.seconds = time.perf_counter() - t0
            return _unique([*transferred[: n // 2], *unmeasured_fresh])[: 2 * n], stats
        seeds = [b for b in (self.space.rebuild(c) for c in best_measured[:n_seed]) if b is not None]
        population = fresh + seeds + transferred
        best: dict[str, tuple[float, Built]] = {}
        for gen in range(cfg.generations + 1):
            if not population:
                break
            scores = model.predict(self.space.features(population))
            stats.scored += len(population)
            for b, s in zip(population, scores):
                key = b.candidate.key
                if key not in measured and math.isfinite(s) and (key not in best or best[key][0] < s):
                    best[key] = (float(s), b)
            best = _best_ranked(best, 2 * n)
            if gen == cfg.generations:
                break
            population = self._breed(population, scores, cfg)
            stats.generations += 1
        ranked = [b for _, b in sorted(best.values(), key=lambda t: -t[0])]
        picks = self._eps_greedy(ranked, unmeasured_fresh, n)
        stats.invalid = self.space.invalid_draws - invalid_before
        stats.seconds = time.perf_counter() - t0
        return picks, stats

    def _breed(self, population: list[Built], scores: np.ndarray, cfg: SearchConfig) -> list[Built]:
        weights = np.where(np.isfinite(scores), np.maximum(scores, 0.0), 0.0)
        if weights.sum() <= 0:
            weights = np.ones(len(population))
        weights = weights + 1e-3 * weights.max()  # every parent keeps a small chance
        cum = np.cumsum(weights)
        total = cum[-1]

        def parent() -> Built:
            return population[
                int(
                    np.searchsorted(cum, self.rng.random() * total, side="right").clip(0, len(population) - 1)
                )
            ]

        children: list[Built] = []
        seen: set[str] = set()
        tries = 0
        while len(children) < cfg.population and tries < 3 * cfg.population:
            tries += 1
            p = parent()
            r = self.rng.random()
            if r < cfg.mutation_prob:
                child = self.space.mutate(p, self.rng, self.space.rules.mutation_weights(cfg))
            elif r < cfg.mutation_prob + cfg.crossover_prob:
                child = self.space.crossover(p, parent(), self.rng)
            else:
                child = p
            if child is None or child.candidate.key in seen:
                continue
            seen.add(child.candidate.key)
            children.append(child)
        return children

    def _eps_greedy(self, ranked: list[Built], randoms: list[Built], n: int) -> list[Built]:
        n_random = random_picks(n, self.config)
        picks: list[Built] = []
        taken: set[str] = set()

        def take(b: Built) -> None:
            if b.candidate.key not in taken:
                taken.add(b.candidate.key)
                picks.append(b)

        for b in ranked[: n - n_random]:
            take(b)
        pool = [b for b in randoms if b.candidate.key not in taken]
        self.rng.shuffle(pool)
        for b in pool[:n_random]:
            take(b)
        # backups, in order of preference, for programs TVM rejects
        for b in ranked[n - n_random :]:
            if len(picks) >= 2 * n:
                break
            take(b)
        for b in pool[n_random:]:
            if len(picks) >= 2 * n:
                break
            take(b)
        return picks
