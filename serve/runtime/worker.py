"""The compiler's verification and timing worker: runs candidates through the model runtime, in the server environment.

Started by `scorestack.serve.worker.RuntimeWorker` with the server environment's Python; it loads
each candidate exactly as Triton's Python backend would (`ModelRuntime` from the same file), runs
the batcher's join/run/split path on the rows it is sent, and times candidates in interleaved
rounds. Self-contained like the runtime (numpy<2, no scorestack installed).

Protocol on stdin/stdout, one frame per message: 8-byte big-endian header length, a JSON header,
then the blobs the header lists (`blobs`: byte lengths), each an .npy file (stable across numpy 1/2).
"""

import importlib.metadata
import io
import json
import os
import random
import struct
import sys
import time
import traceback

import numpy as np

try:  # imported as scorestack.serve.runtime.worker by the compiler's side, for the framing
    from . import scorestack_runtime as rt
except ImportError:  # run as a script in the server environment
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import scorestack_runtime as rt


def _read_exact(stream, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def read_frame(stream):
    (n,) = struct.unpack(">Q", _read_exact(stream, 8))
    header = json.loads(_read_exact(stream, n))
    blobs = [np.load(io.BytesIO(_read_exact(stream, size)), allow_pickle=False) for size in header.get("blobs", [])]
    return header, blobs


def write_frame(stream, header, arrays=()):
    payloads = []
    for a in arrays:
        b = io.BytesIO()
        np.save(b, np.ascontiguousarray(a), allow_pickle=False)
        payloads.append(b.getvalue())
    header = dict(header, blobs=[len(p) for p in payloads])
    raw = json.dumps(header).encode()
    stream.write(struct.pack(">Q", len(raw)) + raw + b"".join(payloads))
    stream.flush()


# The libraries a report names, by module, and the distributions that install each (a GPU or CPU-only build
# ships the same module under another name).
_DISTRIBUTIONS = {
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "xgboost": ("xgboost", "xgboost-cpu"),
    "lightgbm": ("lightgbm",),
    "sklearn": ("scikit-learn",),
    "tl2cgen": ("tl2cgen",),
}


class Worker:
    def __init__(self):
        self.models = {}

    def hello(self, msg, blobs):
        # Versions from the installed distributions' metadata, not by importing the libraries: the imports
        # took ~0.7 s of every worker's start (0.95 s -> 0.25 s measured), i.e. of every compile (a candidate imports what it uses).
        versions = {}
        for lib, dists in _DISTRIBUTIONS.items():
            versions[lib] = "unavailable (not installed)"
            for dist in dists:
                try:
                    versions[lib] = importlib.metadata.version(dist)
                    break
                except importlib.metadata.PackageNotFoundError:
                    continue
        return {"python": sys.executable, "numpy": np.__version__, "libraries": versions}, []

    def load(self, msg, blobs):
        t0 = time.perf_counter()
        self.models[msg["key"]] = rt.ModelRuntime(msg["name"], msg["version_dir"], msg["config"])
        return {"load_s": time.perf_counter() - t0}, []

    def unload(self, msg, blobs):
        self.models.pop(msg["key"], None)
        return {}, []

    def execute(self, msg, blobs):
        """Split the rows into the given request sizes, execute them as one batcher call, concatenate back."""
        model = self.models[msg["key"]]
        (X,) = blobs
        requests, start = [], 0
        for size in msg["sizes"]:
            requests.append([X[start : start + size]])
            start += size
        results = model.execute(requests)
        errors = {}
        width = None
        for r in results:
            if not isinstance(r, Exception):
                width = r[0].reshape(len(r[0]), -1).shape[1]
                break
        parts = []
        for i, (size, r) in enumerate(zip(msg["sizes"], results)):
            if isinstance(r, Exception):
                errors[str(i)] = str(r)
                parts.append(np.full((size, width or 1), np.nan, dtype=np.float64))
            else:
                parts.append(np.asarray(r[0], dtype=np.float64).reshape(size, -1))
        out = np.concatenate(parts) if parts else np.zeros((0, 1))
        return {"errors": errors}, [out]

    def measure(self, msg, blobs):
        """Median µs per execute() call per model and batch size, interleaved rounds in shuffled order."""
        (X,) = blobs
        keys, sizes = list(msg["keys"]), [int(b) for b in msg["batch_sizes"]]
        requests = {b: [[[x]] for x in distinct_batches(X, b)] for b in sizes}  # execute() takes a list of requests
        samples = {k: {b: [] for b in sizes} for k in keys}
        for k in keys:  # warm-up: first calls allocate arenas and load code pages
            for b in sizes:
                self.models[k].execute(requests[b][0])
        rng = random.Random(msg.get("seed", 0))
        clock = time.perf_counter_ns
        for _ in range(int(msg["rounds"])):
            rng.shuffle(keys)
            for k in keys:
                execute = self.models[k].execute
                for b in sizes:
                    batches = requests[b]
                    out = samples[k][b]
                    deadline = time.perf_counter() + float(msg["cell_budget_s"])
                    calls = 0
                    while calls < msg["min_calls"] or (calls < msg["max_calls"] and time.perf_counter() < deadline):
                        request = batches[calls % len(batches)]
                        t0 = clock()
                        result = execute(request)
                        out.append((clock() - t0) / 1000.0)
                        calls += 1
                    if isinstance(result[0], Exception):
                        raise RuntimeError(f"{k} failed at batch {b} while timing: {result[0]}")
        table = {k: {str(b): float(np.median(v)) for b, v in per.items()} for k, per in samples.items()}
        return {"table": table}, []


def distinct_batches(X, b, limit=64):
    """Up to `limit` batches of `b` different held-out rows, to be timed in turn.

    Timing one batch over and over lets the CPU's branch predictor learn its rows' paths through
    the trees: TL2cgen's if-chains then measured 1.3-2.6x faster at batch 1-64 than on rows it has
    not seen, which is what live traffic sends (XGBoost <= 1.06x, the branch-free tree kernel
    <= 1.02x; benchmarks/results/tree_kernel.md). With
    fewer than 2*b rows, the rows are repeated up to b (rows may be N-D: images).
    """
    if len(X) < 2 * b:
        return [np.ascontiguousarray(np.resize(X, (b,) + X.shape[1:]), dtype=X.dtype)]
    return [np.ascontiguousarray(X[i * b : (i + 1) * b]) for i in range(min(limit, len(X) // b))]


def median_us(fn, batches, budget_s=0.15, max_calls=2000, min_calls=5):
    """Median µs of `fn` called on `batches` in turn (distinct_batches) for about `budget_s`: the
    benchmarks' in-process counterpart of `Worker.measure`."""
    fn(batches[0])
    samples = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < min_calls or (len(samples) < max_calls and time.perf_counter() < deadline):
        x = batches[len(samples) % len(batches)]
        t0 = time.perf_counter_ns()
        fn(x)
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    return float(np.median(samples))


def main():
    # Libraries may print to stdout; keep the protocol on a private copy of it.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    proto_in = os.fdopen(os.dup(0), "rb")
    worker = Worker()
    while True:
        try:
            msg, blobs = read_frame(proto_in)
        except EOFError:
            return 0
        op = msg.get("op")
        if op == "quit":
            write_frame(proto_out, {"ok": True})
            return 0
        try:
            reply, arrays = getattr(worker, op)(msg, blobs)
            write_frame(proto_out, dict(reply, ok=True), arrays)
        except Exception as exc:  # every failure goes back to the compiler, with its reason
            detail = str(exc) if isinstance(exc, rt.RuntimeLoadError) else f"{type(exc).__name__}: {exc}"
            write_frame(proto_out, {"ok": False, "error": detail, "traceback": traceback.format_exc()[-2000:]})


if __name__ == "__main__":
    sys.exit(main())
