"""Verification: a candidate must reproduce its source on held-out rows, one row at a time and in one big batch.

The candidate runs through `execute(X, sizes)`: the model runtime's join/run/split path in the
server environment (a RuntimeWorker), with X split into requests of the given sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .model import Holdout

# X, request sizes -> (outputs [n, k], {request index: error})
Execute = Callable[[np.ndarray, list[int]], tuple[np.ndarray, dict[int, str]]]
# Request sizes the large batch is cut into, cycled: the batcher joins requests of mixed sizes.
_MIXED_SIZES = (1, 7, 64, 2, 31, 128, 3, 16)


@dataclass(frozen=True)
class Verification:
    verified: bool
    max_abs_diff: float | None
    label_agreement: float | None  # classifiers: share of rows with the same decision
    rank_agreement: float | None  # rankers: share of ordered pairs within groups kept in order
    rows_batch1: int
    rows_large: int
    reason: str | None = None
    accuracy: float | None = None  # image models: share of held-out images classified as labelled
    argmax_agreement: float | None = None  # image models: share of images whose top class equals the reference's
    outputs: np.ndarray | None = None  # image models: the candidate's outputs on every held-out row (the serving check's reference)


def needed_tolerance(ref: np.ndarray, out: np.ndarray, relative: float) -> float:
    """The smallest absolute tolerance under which `out` matches `ref`, given the relative one:
    max(|out - ref| - relative * |ref|), at least 0."""
    if ref.size == 0:
        return 0.0
    return float(max(0.0, (np.abs(out - ref) - relative * np.abs(ref)).max()))


def needed_relative(ref: np.ndarray, out: np.ndarray, tolerance: float) -> float | None:
    """The smallest relative tolerance under which `out` matches `ref`, given the absolute one; None
    where no relative tolerance would do (a miss where the reference is 0)."""
    excess = np.abs(out - ref) - tolerance
    miss = excess > 0
    if not miss.any():
        return 0.0
    scale = np.abs(ref[miss])
    if (scale == 0).any():
        return None
    return float((excess[miss] / scale).max())


def tolerance_text(tolerance: float, relative: float) -> str:
    return f"{tolerance:g}" if relative == 0 else f"{tolerance:g} + {relative:g}·|source|"


def miss_text(diff: float, need: float, tolerance: float, relative: float, need_relative: float | None = None) -> str:
    """Why a comparison failed, with the settings and the values that would have passed."""
    text = (
        f"max |Δ| {diff:.3g} > tolerance {tolerance_text(tolerance, relative)}; "
        f"passes with verification.tolerance: {_round_up(need)} (relative_tolerance {relative:g})"
    )
    if need_relative is not None and need_relative > relative:
        text += f" or verification.relative_tolerance: {_round_up(need_relative)} (tolerance {tolerance:g})"
    return text


def _round_up(x: float) -> str:
    """`x` rounded up to two significant digits, as a spec would write it."""
    if x <= 0:
        return "0"
    e = int(np.floor(np.log10(x))) - 1
    return f"{np.ceil(x / 10.0**e) * 10.0**e:.2g}"


def sample_indices(n: int, k: int) -> np.ndarray:
    """Evenly spread row indices (deterministic, so reruns check the same rows)."""
    return np.unique(np.linspace(0, n - 1, min(k, n)).astype(np.int64))


def label_agreement(task: str, ref: np.ndarray, out: np.ndarray, tol: float) -> float | None:
    """Share of rows where the decision agrees; rows whose reference sits within `tol` of a tie are not counted."""
    if task == "binary":
        clear = np.abs(ref[:, 0] - 0.5) > tol
        if not clear.any():
            return 1.0
        return float(np.mean((ref[clear, 0] >= 0.5) == (out[clear, 0] >= 0.5)))
    if task in ("multiclass", "image-classification"):
        top2 = np.sort(ref, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > tol
        if not clear.any():
            return 1.0
        return float(np.mean(ref[clear].argmax(1) == out[clear].argmax(1)))
    return None


def rank_agreement(ref: np.ndarray, out: np.ndarray, groups: np.ndarray, tol: float) -> float:
    """Share of item pairs within each group whose order the candidate keeps (pairs closer than 2*tol are ties)."""
    kept = total = 0
    start = 0
    r, o = ref[:, 0], out[:, 0]
    for size in groups:
        rs, os_ = r[start : start + size], o[start : start + size]
        start += size
        dr = rs[:, None] - rs[None, :]
        do = os_[:, None] - os_[None, :]
        ordered = dr > 2 * tol
        total += int(ordered.sum())
        kept += int((ordered & (do > 0)).sum())
    return 1.0 if total == 0 else kept / total


def mixed_sizes(n: int) -> list[int]:
    """Request sizes summing to n, cycling through small and large ones."""
    sizes: list[int] = []
    i = 0
    while n > 0:
        s = min(_MIXED_SIZES[i % len(_MIXED_SIZES)], n)
        sizes.append(s)
        n -= s
        i += 1
    return sizes


def _run(execute: Execute, X: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The candidate's outputs on rows `idx` one per call, and on every row as one joined batch of mixed-size requests."""
    ones = []
    for i in idx:
        out, errors = execute(X[i : i + 1], [1])
        if errors:
            raise RuntimeError(f"row {int(i)} at batch 1: {errors[0]}")
        ones.append(out.reshape(1, -1))
    big, errors = execute(X, mixed_sizes(len(X)))
    if errors:
        k, msg = next(iter(errors.items()))
        raise RuntimeError(f"{len(errors)} of the joined requests failed, e.g. request {k}: {msg}")
    return np.concatenate(ones), big


def verify(
    execute: Execute, reference: np.ndarray, holdout: Holdout, task: str, tolerance: float, sample_rows: int, relative: float = 0.0
) -> Verification:
    """Run the candidate one row per call on a sample, and on every row as one joined batch of mixed-size requests; compare with `reference`.

    A value matches where |candidate - reference| <= tolerance + relative * |reference|."""
    X = holdout.X
    idx = sample_indices(len(X), sample_rows)
    try:
        one, big = _run(execute, X, idx)
    except Exception as exc:  # a failure at run time is a verification failure, with its reason
        return Verification(False, None, None, None, 0, 0, f"failed to run: {exc}")
    ref = reference.reshape(len(X), -1)
    for label, out, want in (("batch 1", one, ref[idx]), (f"batch {len(X)}", big, ref)):
        if out.shape != want.shape:
            return Verification(False, None, None, None, len(idx), len(X), f"{label}: output shape {out.shape}, expected {want.shape}")
        if not np.isfinite(out).all():
            return Verification(False, None, None, None, len(idx), len(X), f"{label}: output holds NaN or inf")
    big = big.astype(np.float64)
    one = one.astype(np.float64)
    diff = float(max(np.abs(one - ref[idx]).max(), np.abs(big - ref).max()))
    need = max(needed_tolerance(ref[idx], one, relative), needed_tolerance(ref, big, relative))
    labels = label_agreement(task, ref, big, tolerance)
    labels_one = label_agreement(task, ref[idx], one, tolerance)
    if labels is not None and labels_one is not None:
        labels = min(labels, labels_one)
    ranks = None
    if task == "ranking" and holdout.groups is not None:
        ranks = rank_agreement(ref, big, holdout.groups, tolerance)
    reasons = []
    if need > tolerance:
        rel_one, rel_big = needed_relative(ref[idx], one, tolerance), needed_relative(ref, big, tolerance)
        need_rel = None if rel_one is None or rel_big is None else max(rel_one, rel_big)
        reasons.append(miss_text(diff, need, tolerance, relative, need_rel))
    if labels is not None and labels < 1.0:
        reasons.append(f"label agreement {labels:.2%} < 100%")
    if ranks is not None and ranks < 1.0:
        reasons.append(f"ranking-order agreement {ranks:.2%} < 100%")
    return Verification(not reasons, diff, labels, ranks, len(idx), len(X), "; ".join(reasons) or None)


def accuracy(probabilities: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(probabilities.argmax(1) == labels))


def verify_images(
    execute: Execute,
    reference: np.ndarray,
    holdout: Holdout,
    *,
    exact: bool,
    tolerance: float,
    source_accuracy: float,
    accuracy_budget: float,
    sample_rows: int,
) -> Verification:
    """An image classifier candidate on every held-out image (joined batch) and a sample at batch 1.

    `reference`: probabilities of the model the candidate was converted from (fp32). An exact
    candidate (fp32 ONNX) must reproduce them within `tolerance` with the same top class wherever the
    reference has one; every candidate (INT8 too) must stay within `accuracy_budget` of the source's
    accuracy on the labelled images, and reproduce its own joined-batch top classes at batch 1."""
    X = holdout.X
    idx = sample_indices(len(X), sample_rows)
    try:
        one, big = _run(execute, X, idx)
    except Exception as exc:  # a failure at run time is a verification failure, with its reason
        return Verification(False, None, None, None, 0, 0, f"failed to run: {exc}")
    ref = reference.reshape(len(X), -1)
    if big.shape != ref.shape or one.shape != ref[idx].shape:
        return Verification(False, None, None, None, len(idx), len(X), f"output shape {big.shape}, expected {ref.shape}")
    if not (np.isfinite(big).all() and np.isfinite(one).all()):
        return Verification(False, None, None, None, len(idx), len(X), "output holds NaN or inf")
    diff = float(max(np.abs(one - ref[idx]).max(), np.abs(big - ref).max()))
    labels = label_agreement("image-classification", ref, big, tolerance)
    agree = float(np.mean(big.argmax(1) == ref.argmax(1)))
    acc = accuracy(big, holdout.y) if holdout.y is not None else None
    reasons = []
    if exact and diff > tolerance:
        reasons.append(f"max |Δ| {diff:.3g} > tolerance {tolerance:g}")
    if exact and labels is not None and labels < 1.0:
        reasons.append(f"top-class agreement {labels:.2%} < 100%")
    if acc is not None and source_accuracy - acc > accuracy_budget + 1e-12:
        reasons.append(f"accuracy {acc:.2%} is {100 * (source_accuracy - acc):.2f} points below the source's {source_accuracy:.2%} (budget {100 * accuracy_budget:.2f})")
    # One image alone and the same image inside a joined batch must get the same top class (quantized
    # kernels could differ by batch size; ties closer than the tolerance are not counted).
    self_labels = label_agreement("image-classification", big[idx], one, tolerance)
    if self_labels is not None and self_labels < 1.0:
        reasons.append(f"batch 1 and the joined batch disagree on the top class of {1 - self_labels:.2%} of the sampled images")
    return Verification(not reasons, diff, labels, None, len(idx), len(X), "; ".join(reasons) or None, acc, agree, big)


@dataclass(frozen=True)
class BandCheck:
    verified: bool
    sizes: list[int]  # request sizes sent, each as one request (so the runtime executes exactly that many rows)
    max_abs_diff: float | None
    reason: str | None = None


def verify_bands(
    execute: Execute, predict: Callable[[np.ndarray], np.ndarray], holdout: Holdout, bands: list[tuple[int, int]], task: str, tolerance: float,
    relative: float = 0.0,
) -> BandCheck:
    """Send one request at each band's first and last batch size, so every format of a dispatch runs at its edges.

    Rows are the held-out rows in order, repeated when a band is larger than the held-out set."""
    sizes = sorted({n for lo, hi in bands for n in (lo, hi)})
    worst = 0.0
    for n in sizes:
        X = holdout.X[np.arange(n) % len(holdout.X)]
        try:
            out, errors = execute(X, [n])
        except Exception as exc:  # a failure at run time fails the check, with its reason
            return BandCheck(False, sizes, None, f"batch {n}: failed to run: {exc}")
        if errors:
            return BandCheck(False, sizes, None, f"batch {n}: {errors[0]}")
        want = predict(X).reshape(n, -1)
        if out.shape != want.shape or not np.isfinite(out).all():
            return BandCheck(False, sizes, None, f"batch {n}: output shape {out.shape} (expected {want.shape}) or NaN")
        diff = float(np.abs(out.astype(np.float64) - want).max())
        need = needed_tolerance(want, out.astype(np.float64), relative)
        worst = max(worst, diff)
        labels = label_agreement(task, want, out, tolerance)
        if need > tolerance or (labels is not None and labels < 1.0):
            why = miss_text(diff, need, tolerance, relative, needed_relative(want, out.astype(np.float64), tolerance)) if need > tolerance else f"max |Δ| {diff:.3g}"
            return BandCheck(False, sizes, worst, f"batch {n}: {why}, label agreement {labels}")
    return BandCheck(True, sizes, worst)
