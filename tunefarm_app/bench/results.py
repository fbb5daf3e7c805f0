"""What `tunefarm bench ops` measured: one `OpRow` per op, the `Summary` over the rows and
the benchmark's targets, each judged PASS / MISS (or n/a when a number is missing).

Throughput is GFLOPS, or GB/s for memory-bound ops (`Workload.throughput`); a ratio
"ours/peer" is the peer's seconds per call over ours, so > 1 means tunefarm is faster.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tunefarm_app.bench.heldout import HeldOutAccuracy

TARGET_TRIALS = 256
"""The trial budget the targets are set for."""

GEOMEAN_VS_MS_TARGET = 1.0
"""Geomean over ops of ours/MetaSchedule must be at least this."""

MIN_VS_MS_TARGET = 0.8
"""No op's ours/MetaSchedule may be below this."""

GEMM_VS_NUMPY_TARGET = 0.8
"""GEMM 1024's ours/numpy must be at least this."""

GEMM_OP_ID = "gemm1024"
"""The op the numpy target is judged on."""

SEARCH_SHARE_TARGET = 0.25
"""The mean over ops of search time / tuning wall time must be at most this."""

PER_TRIAL_RATIO_TARGET = 1.0
"""Our tuning wall seconds per trial over MetaSchedule's must be at most this."""

GEOMEAN_VS_VENDOR_TARGET = 1.0
"""Geomean over ops of ours / the best vendor library (numpy or PyTorch) must be at least this."""

MIN_VS_VENDOR_TARGET = 0.7
"""No op's ours / best vendor may be below this."""

CONV_OP_IDS = ("conv2d", "conv1x1", "conv2d_nhwc", "conv1x1_nhwc")
CONV_VS_TORCH_TARGET = 0.8
"""The convolutions against PyTorch's (oneDNN on a CPU, cuDNN on a GPU) must reach at least this."""

PEAK_SHARE_TARGET = 0.8
"""GEMM 1024 and the direct convolutions in a model's layouts (3x3 and 1x1, NHWC) must each
reach this share of the FMA peak measured in the same run."""

PEAK_OP_IDS = (GEMM_OP_ID, "conv2d_nhwc", "conv1x1_nhwc")
"""The ops the peak target is judged on."""


@dataclass(frozen=True)
class OursRun:
    """tunefarm's tuning of one op and the bench's timing of its best kernel."""

    secs: float | None  # bench timing of the best kernel (None: none, or it failed)
    recorded_secs: float | None  # the best cost measured during tuning
    trials: int  # measurements made in this run
    errors: int  # of which failed
    wall_secs: float
    search_secs: float

    @property
    def secs_per_trial(self) -> float | None:
        return self.wall_secs / self.trials if self.trials else None

    @property
    def search_share(self) -> float | None:
        return self.search_secs / self.wall_secs if self.wall_secs else None


@dataclass(frozen=True)
class MetaScheduleRun:
    """MetaSchedule's tuning of one op (in its child) and the bench's timing of its best kernel."""

    secs: float | None  # bench timing of the best kernel (None: none, or it failed / was wrong)
    recorded_secs: float | None  # MetaSchedule's own timing of its best candidate
    trials: int  # measured candidates, failed ones included
    valid_trials: int
    tune_secs: float  # wall time of tune_tir
    setup_secs: float  # one-off start-up left out of tune_secs (see ms_peer)

    @property
    def secs_per_trial(self) -> float | None:
        return self.tune_secs / self.trials if self.trials else None


@dataclass(frozen=True)
class OpRow:
    op: str  # bench op id
    workload: str  # registry display name with every parameter
    unit: str  # "GFLOPS" or "GB/s"
    work: float  # FLOPs, or bytes moved, per call
    ours: OursRun | None
    ms: MetaScheduleRun | None
    numpy_secs: float | None
    torch_secs: float | None
    heldout: HeldOutAccuracy | None  # k-fold over the distinct programs
    notes: tuple[str, ...] = ()
    peak_gflops: float | None = None  # the FMA peak measured in the same run (`fma_peak`)
    heldout_rolling: HeldOutAccuracy | None = None  # each round ranked by a model of the rounds before it

    def throughput(self, secs: float | None) -> float | None:
        return self.work / secs / 1e9 if secs and math.isfinite(secs) else None

    @property
    def ours_secs(self) -> float | None:
        return self.ours.secs if self.ours else None

    @property
    def ms_secs(self) -> float | None:
        return self.ms.secs if self.ms else None

    @property
    def vendor_secs(self) -> float | None:
        """The faster vendor library's seconds per call (numpy or PyTorch)."""
        secs = [s for s in (self.numpy_secs, self.torch_secs) if s and math.isfinite(s)]
        return min(secs) if secs else None

    def ratio(self, peer_secs: float | None) -> float | None:
        """ours/peer in throughput: the peer's seconds over ours."""
        ours = self.ours_secs
        return peer_secs / ours if ours and peer_secs else None

    def peak_share(self, secs: float | None) -> float | None:
        """GFLOPS at `secs` per call over the measured FMA peak (None for memory-bound ops)."""
        gflops = self.throughput(secs)
        if self.unit != "GFLOPS" or gflops is None or not self.peak_gflops:
            return None
        return gflops / self.peak_gflops

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["throughput"] = {
            "ours": self.throughput(self.ours_secs),
            "metaschedule": self.throughput(self.ms_secs),
            "numpy": self.throughput(self.numpy_secs),
            "torch": self.throughput(self.torch_secs),
        }
        d["ratio"] = {
            "metaschedule": self.ratio(self.ms_secs),
            "numpy": self.ratio(self.numpy_secs),
            "torch": self.ratio(self.torch_secs),
            "best_vendor": self.ratio(self.vendor_secs),
        }
        d["peak_share"] = {"ours": self.peak_share(self.ours_secs), "metaschedule": self.peak_share(self.ms_secs)}
        d["ours_secs_per_trial"] = self.ours.secs_per_trial if self.ours else None
        d["ours_search_share"] = self.ours.search_share if self.ours else None
        d["ms_secs_per_trial"] = self.ms.secs_per_trial if self.ms else None
        return _finite(d)


@dataclass(frozen=True)
class TargetCheck:
    name: str
    value: float | None
    status: str  # "PASS", "MISS" or "n/a"


@dataclass(frozen=True)
class Summary:
    geomean_vs_ms: float | None
    min_vs_ms: float | None
    min_vs_ms_op: str | None
    gemm_vs_numpy: float | None
    mean_search_share: float | None
    ours_secs_per_trial: float | None  # over the ops MetaSchedule tuned too
    ms_secs_per_trial: float | None
    per_trial_ratio: float | None  # ours / MetaSchedule
    ms_setup_secs: float | None  # MetaSchedule's one-off start-ups, summed (not in its per-trial time)
    mean_heldout_pairwise: float | None
    mean_heldout_recall: float | None
    mean_heldout_spearman: float | None = None
    heldout_pairs: int = 0  # pairs compared, all ops
    heldout_pairs_dropped: int = 0  # pairs within the measurement noise, all ops
    mean_rolling_pairwise: float | None = None  # rounds ranked by the model of the rounds before them
    geomean_vs_vendor: float | None = None
    min_vs_vendor: float | None = None
    min_vs_vendor_op: str | None = None
    conv_vs_torch: float | None = None  # the lower of the convolutions' ours/torch
    gemm_peak_share: float | None = None
    min_peak_share: float | None = None  # the lowest share of the FMA peak among PEAK_OP_IDS
    min_peak_share_op: str | None = None
    peak_gflops: float | None = None
    targets: tuple[TargetCheck, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"] = [asdict(t) for t in self.targets]
        return _finite(d)


def summarize(rows: list[OpRow]) -> Summary:
    vs_ms = {r.op: v for r in rows if (v := _vs_ms(r)) is not None}
    gemm = next((r.ratio(r.numpy_secs) for r in rows if r.op == GEMM_OP_ID), None)
    shares = [r.ours.search_share for r in rows if r.ours and r.ours.search_share is not None]
    ours_pt, ms_pt = _per_trial(rows)
    ratio_pt = ours_pt / ms_pt if ours_pt and ms_pt else None
    min_op = min(vs_ms, key=lambda k: vs_ms[k]) if vs_ms else None
    vs_vendor = {r.op: v for r in rows if (v := r.ratio(r.vendor_secs)) is not None}
    min_vendor_op = min(vs_vendor, key=lambda k: vs_vendor[k]) if vs_vendor else None
    conv = [v for r in rows if r.op in CONV_OP_IDS and (v := r.ratio(r.torch_secs)) is not None]
    gemm_row = next((r for r in rows if r.op == GEMM_OP_ID), None)
    shares_of_peak = {r.op: v for r in rows if r.op in PEAK_OP_IDS and (v := r.peak_share(r.ours_secs)) is not None}
    min_peak_op = min(shares_of_peak, key=lambda k: shares_of_peak[k]) if shares_of_peak else None
    s = Summary(
        geomean_vs_ms=_geomean(list(vs_ms.values())),
        min_vs_ms=vs_ms[min_op] if min_op else None,
        min_vs_ms_op=min_op,
        gemm_vs_numpy=gemm,
        mean_search_share=sum(shares) / len(shares) if shares else None,
        ours_secs_per_trial=ours_pt,
        ms_secs_per_trial=ms_pt,
        per_trial_ratio=ratio_pt,
        ms_setup_secs=sum(r.ms.setup_secs for r in rows if r.ms) if any(r.ms for r in rows) else None,
        mean_heldout_pairwise=_mean([r.heldout.pairwise for r in rows if r.heldout]),
        mean_heldout_recall=_mean([r.heldout.recall for r in rows if r.heldout]),
        mean_heldout_spearman=_mean([r.heldout.spearman for r in rows if r.heldout]),
        heldout_pairs=sum(r.heldout.pairs for r in rows if r.heldout),
        heldout_pairs_dropped=sum(r.heldout.dropped for r in rows if r.heldout),
        mean_rolling_pairwise=_mean([r.heldout_rolling.pairwise for r in rows if r.heldout_rolling]),
        geomean_vs_vendor=_geomean(list(vs_vendor.values())),
        min_vs_vendor=vs_vendor[min_vendor_op] if min_vendor_op else None,
        min_vs_vendor_op=min_vendor_op,
        conv_vs_torch=min(conv) if conv else None,
        gemm_peak_share=gemm_row.peak_share(gemm_row.ours_secs) if gemm_row else None,
        min_peak_share=shares_of_peak[min_peak_op] if min_peak_op else None,
        min_peak_share_op=min_peak_op,
        peak_gflops=next((r.peak_gflops for r in rows if r.peak_gflops), None),
    )
    return Summary(**{**s.__dict__, "targets": _targets(s)})


def _targets(s: Summary) -> tuple[TargetCheck, ...]:
    return (
        _check(
            f"geomean ours/MS >= {GEOMEAN_VS_MS_TARGET:.1f}x",
            s.geomean_vs_ms,
            lambda v: v >= GEOMEAN_VS_MS_TARGET,
        ),
        _check(f"no op below {MIN_VS_MS_TARGET:.1f}x MS", s.min_vs_ms, lambda v: v >= MIN_VS_MS_TARGET),
        _check(
            f"GEMM 1024 >= {GEMM_VS_NUMPY_TARGET:.1f}x numpy",
            s.gemm_vs_numpy,
            lambda v: v >= GEMM_VS_NUMPY_TARGET,
        ),
        _check(
            f"search <= {SEARCH_SHARE_TARGET:.0%} of tuning wall time",
            s.mean_search_share,
            lambda v: v <= SEARCH_SHARE_TARGET,
        ),
        _check("our wall time per trial <= MS's", s.per_trial_ratio, lambda v: v <= PER_TRIAL_RATIO_TARGET),
        _check(
            f"geomean ours/best vendor >= {GEOMEAN_VS_VENDOR_TARGET:.1f}x",
            s.geomean_vs_vendor,
            lambda v: v >= GEOMEAN_VS_VENDOR_TARGET,
        ),
        _check(
            f"no op below {MIN_VS_VENDOR_TARGET:.1f}x best vendor", s.min_vs_vendor, lambda v: v >= MIN_VS_VENDOR_TARGET
        ),
        _check(
            f"conv 3x3 and 1x1 >= {CONV_VS_TORCH_TARGET:.1f}x torch",
            s.conv_vs_torch,
            lambda v: v >= CONV_VS_TORCH_TARGET,
        ),
        _check(
            f"GEMM 1024, conv 3x3 and 1x1 (NHWC) each >= {PEAK_SHARE_TARGET:.0%} of FMA peak",
            s.min_peak_share,
            lambda v: v >= PEAK_SHARE_TARGET,
        ),
    )


def _vs_ms(row: OpRow) -> float | None:
    """ours/MS of a row for the targets: 0 when MetaSchedule has a kernel and we have none."""
    if not row.ms_secs:
        return None
    return row.ratio(row.ms_secs) if row.ours_secs else 0.0


def _check(name: str, value: float | None, ok) -> TargetCheck:
    if value is None or not math.isfinite(value):
        return TargetCheck(name, None, "n/a")
    return TargetCheck(name, value, "PASS" if ok(value) else "MISS")


def _per_trial(rows: list[OpRow]) -> tuple[float | None, float | None]:
    """Wall seconds per trial, summed over the ops both tuners tuned (same op set on both sides)."""
    both = [(r.ours, r.ms) for r in rows if r.ours and r.ms and r.ours.trials and r.ms.trials]
    if not both:
        return None, None
    ours = sum(o.wall_secs for o, _ in both) / sum(o.trials for o, _ in both)
    ms = sum(m.tune_secs for _, m in both) / sum(m.trials for _, m in both)
    return ours, ms


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    if min(values) <= 0:
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _finite(obj: Any) -> Any:
    """NaN and infinities -> None, recursively (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
