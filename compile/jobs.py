"""Batch compile jobs: many specs, each in its own process, so one model's failure (or crash) leaves the others alone."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from scorestack.errors import ScorestackError
from scorestack.paths import default_repository


@dataclass(frozen=True)
class JobResult:
    """The outcome of compiling one spec."""

    spec: str
    name: str
    status: str  # compiled | skipped (unchanged) | failed
    duration_s: float
    selected: str | None = None
    version: int | None = None
    latency_us: dict[str, float] = field(default_factory=dict)
    folder: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status != "failed"


def _spec_name(spec: Path) -> str:
    try:
        import yaml

        data = yaml.safe_load(spec.read_text())
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            return data["name"]
    except Exception:  # the name is only a label here
        pass
    return spec.stem


def run_one(spec: str | Path, repository: str | Path, force: bool = False, serve_check: bool = True, batch_profile: str | Path | None = None) -> JobResult:
    """Compile one spec in this process and describe the outcome (never raises for a model's failure)."""
    from .pipeline import compile_model

    spec = Path(spec)
    t0 = time.perf_counter()
    try:
        report = compile_model(spec, repository, force=force, serve_check=serve_check, batch_profile=batch_profile)
    except ScorestackError as exc:
        return JobResult(str(spec), _spec_name(spec), "failed", round(time.perf_counter() - t0, 2), error=str(exc))
    except Exception as exc:  # reported with its traceback tail, the batch goes on
        tail = "".join(traceback.format_exception(exc)[-3:]).strip()
        return JobResult(str(spec), _spec_name(spec), "failed", round(time.perf_counter() - t0, 2), error=f"{type(exc).__name__}: {exc}\n{tail}")
    return JobResult(
        str(spec),
        report.name,
        "skipped" if report.skipped else "compiled",
        round(time.perf_counter() - t0, 2),
        selected=report.selected.format,
        version=report.version,
        latency_us=report.selected.latency_us,
        folder=report.output.get("folder"),
    )


@dataclass
class _Running:
    spec: Path
    proc: subprocess.Popen
    result_file: Path
    log_file: Path
    started: float


def _start(index: int, spec: Path, repository: Path, force: bool, serve_check: bool, tmp: Path, batch_profile: Path | None) -> _Running:
    result_file = tmp / f"{index}-{spec.stem}.json"
    log_file = result_file.with_suffix(".log")
    cmd = [sys.executable, "-m", "scorestack.compile.jobs", "--worker", str(spec), "--repository", str(repository), "--result", str(result_file)]
    if force:
        cmd.append("--force")
    if not serve_check:
        cmd.append("--no-serve-check")
    if batch_profile is not None:
        cmd += ["--batch-profile", str(batch_profile)]
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return _Running(spec, proc, result_file, log_file, time.perf_counter())


def _finish(run: _Running) -> JobResult:
    if run.result_file.exists():
        return JobResult(**json.loads(run.result_file.read_text()))
    log = run.log_file.read_text(errors="replace")[-1500:] if run.log_file.exists() else ""
    return JobResult(
        str(run.spec),
        _spec_name(run.spec),
        "failed",
        round(time.perf_counter() - run.started, 2),
        error=f"compile worker exited with code {run.proc.returncode} without a result\n{log}".strip(),
    )


def compile_many(
    specs: Sequence[str | Path],
    repository: str | Path | None = None,
    jobs: int = 1,
    force: bool = False,
    on_update: Callable[[str, JobResult | None], None] | None = None,
    timeout_s: float = 3600.0,
    serve_check: bool = True,
    batch_profile: str | Path | None = None,
) -> list[JobResult]:
    """Compile every spec, each in its own worker process, `jobs` at a time; results in the specs' order.

    `on_update(spec, None)` is called when a spec starts and `on_update(spec, result)` when it ends.
    Parallel jobs share the CPUs the timings are taken on: use jobs=1 where the latency table matters.
    `batch_profile`: Triton's statistics JSON; each model is fitted to its own entry in it.
    """
    profile_path = Path(batch_profile).resolve() if batch_profile is not None else None
    repository = Path(repository) if repository is not None else default_repository()
    repository.mkdir(parents=True, exist_ok=True)
    pending = [Path(s) for s in specs]
    results: dict[int, JobResult] = {}
    running: dict[int, _Running] = {}
    order = list(range(len(pending)))
    with tempfile.TemporaryDirectory(prefix="scorestack-compile-") as tmpdir:
        tmp = Path(tmpdir)
        while order or running:
            while order and len(running) < max(1, jobs):
                i = order.pop(0)
                running[i] = _start(i, pending[i], repository, force, serve_check, tmp, profile_path)
                if on_update:
                    on_update(str(pending[i]), None)
            time.sleep(0.05)
            for i, run in list(running.items()):
                if run.proc.poll() is None:
                    if time.perf_counter() - run.started > timeout_s:
                        run.proc.kill()
                        run.proc.wait()
                    else:
                        continue
                results[i] = _finish(run)
                del running[i]
                if on_update:
                    on_update(str(run.spec), results[i])
    return [results[i] for i in range(len(pending))]


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scorestack.compile.jobs")
    parser.add_argument("--worker", required=True)
    parser.add_argument("--repository", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--no-serve-check", action="store_true")
    parser.add_argument("--batch-profile")
    args = parser.parse_args(argv)
    result = run_one(args.worker, args.repository, force=args.force, serve_check=not args.no_serve_check, batch_profile=args.batch_profile)
    tmp = Path(args.result).with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(result)))
    os.replace(tmp, args.result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
