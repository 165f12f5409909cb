"""Per-batch-size dispatch: the batch sizes the server will execute, and which verified format runs each band of them.

A Triton model with dynamic batching executes whatever batch the batcher forms from live traffic,
from 1 row up to `max_batch_size`, so the compiler measures candidates on a grid over that whole
range and, where no single format is fastest everywhere, serves several from one version folder
with a table from executed batch size to format: the plan in config.pbtxt's `scorestack_dispatch`,
written by `dispatch_parameter` alone and read by the Python runtime and the native backend alike.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from scorestack.serve import runtime_files
from scorestack.serve.runtime import scorestack_runtime as rt

from .registry import Artifact, DispatchBand

# A format takes a band over only where it is more than this much faster than the band's current
# format: timings on a shared 2-core machine wander by 5-10% between rounds, and a band boundary
# chosen by noise would flap from one compile to the next.
MARGIN = 0.10


def grid(max_batch: int, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Batch sizes to measure: powers of two up to `max_batch`, `max_batch` itself, and `extra` (<= max_batch)."""
    sizes = {1 << k for k in range(max_batch.bit_length()) if (1 << k) <= max_batch}
    sizes |= {max_batch, *(b for b in extra if 1 <= b <= max_batch)}
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class Band:
    format: str
    min_rows: int
    max_rows: int


@dataclass(frozen=True)
class Plan:
    bands: tuple[Band, ...]
    best_single: str  # the single format with the lowest weighted latency
    reason: str  # why one format or several, in numbers


def _crossover(old: dict[int, float], new: dict[int, float], sizes: list[int], start: int, upto: int) -> int:
    """First batch size at which `new` runs faster than `old`, searching back from grid size `upto` to the
    band's start and interpolating both curves linearly between the two grid sizes around the crossing."""
    i = sizes.index(upto)
    while i > 0 and sizes[i - 1] >= start and old[sizes[i - 1]] > new[sizes[i - 1]]:
        i -= 1  # `new` was already faster there, by less than the margin
    if i == 0 or sizes[i - 1] < start:
        return max(start + 1, sizes[i])
    lo, hi = sizes[i - 1], sizes[i]
    d_lo, d_hi = old[lo] - new[lo], old[hi] - new[hi]  # d_lo <= 0 < d_hi
    x = lo + (hi - lo) * (-d_lo) / (d_hi - d_lo)
    return min(hi, max(lo + 1, math.ceil(x)))


def plan_bands(curves: dict[str, dict[int, float]], weights: dict[int, float], margin: float = MARGIN) -> Plan:
    """Bands of batch sizes and the format for each, from measured µs per call on a common grid.

    One format (one band) when the format with the lowest weighted latency is within `margin` of the
    fastest at every measured size; otherwise, scanning up from batch 1, a new band starts where
    another format beats the current one by more than `margin`, at the interpolated crossover.
    """
    sizes = sorted(set.intersection(*(set(c) for c in curves.values())))
    best_single = min(curves, key=lambda f: sum(w * curves[f][b] for b, w in weights.items()))
    fastest = {b: min(curves, key=lambda f: curves[f][b]) for b in sizes}
    worst = max(sizes, key=lambda b: curves[best_single][b] / curves[fastest[b]][b])
    ratio = curves[best_single][worst] / curves[fastest[worst]][worst]
    if ratio <= 1 + margin:
        why = f"{best_single} is within {margin:.0%} of the fastest format at every measured batch size (worst: {ratio:.2f}x at batch {worst})"
        return Plan((Band(best_single, 1, sizes[-1]),), best_single, why)
    bands: list[Band] = []
    current, start = fastest[sizes[0]], 1
    for b in sizes[1:]:
        f = fastest[b]
        if f != current and curves[current][b] > (1 + margin) * curves[f][b]:
            edge = _crossover(curves[current], curves[f], sizes, start, b)
            bands.append(Band(current, start, edge - 1))
            current, start = f, edge
    bands.append(Band(current, start, sizes[-1]))
    why = (
        f"the best single format, {best_single}, is {ratio:.2f}x slower than {fastest[worst]} at batch {worst}; "
        + ", ".join(f"{band.format} for {band.min_rows}-{band.max_rows} rows" for band in bands)
    )
    return Plan(tuple(bands), best_single, why)


def band_file(fmt: str, artifact_name: str) -> str:
    """The artifact's name inside a dispatch folder: prefixed by its format (ONNX and hummingbird are both model.onnx)."""
    return f"{fmt}-{artifact_name}"


def package_dispatch(version_dir: Path, plan: Plan, artifacts: dict[str, Artifact]) -> tuple[Artifact, dict[str, str]]:
    """One version folder holding every band's artifact, the runtime and SHA256SUMS; the Artifact that describes it."""
    version_dir.mkdir(parents=True, exist_ok=True)
    bands = []
    for band in plan.bands:
        art = artifacts[band.format]
        name = band_file(band.format, art.artifact_name)
        if not (version_dir / name).exists():
            shutil.copy2(art.path, version_dir / name)
        bands.append(DispatchBand(band.format, band.min_rows, band.max_rows, art.runtime, name, art.output_column, art.method))
    for src in runtime_files():
        shutil.copy2(src, version_dir / src.name)
    digests = rt.write_manifest(str(version_dir))
    artifact = Artifact(
        format="dispatch",
        runtime=rt.DISPATCH,
        backend="python",
        artifact_name=", ".join(dict.fromkeys(b.artifact for b in bands)),
        path=version_dir,
        bands=tuple(bands),
        notes=[plan.reason],
    )
    return artifact, digests


def dispatch_parameter(bands: Iterable[DispatchBand]) -> str:
    """The `scorestack_dispatch` plan of `bands`: the one writer of the format that
    serve/runtime/scorestack_runtime.py specifies (`parse_dispatch`) and both servers read.

    The text is read back with the runtime's own reader before it is returned, so the compiler never
    writes a plan a server would refuse (an artifact name with a space, say): it fails here instead.
    """
    entries = [
        {"min_rows": b.min_rows, "runtime": b.runtime, "artifact": b.artifact, "output_column": b.output_column, "method": b.method} for b in bands
    ]
    text = json.dumps(entries, separators=(",", ":"))
    try:
        read = rt.parse_dispatch(text)
    except rt.PlanError as exc:
        raise ValueError(f"the dispatch plan cannot be written as {rt.PARAM_DISPATCH}: {exc}") from None
    if read != entries:
        raise AssertionError(f"{rt.PARAM_DISPATCH} does not read back as written: {read} != {entries}")
    return text
