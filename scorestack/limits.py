"""Request size limits, stated once: every entry point (clients, ranking, Triton's own settings) reads them here.

A request over a limit is refused at the edge, before features are fetched or a tensor is sent,
with an error naming the field and the limit. Raise a limit here, and only here, when a model
really needs more; the server side is set from the same numbers.
"""

from __future__ import annotations

# Rows in one inference request to Triton (its batch dimension). Every model's max_batch_size must
# stay at or below it; the compiler's largest expected batch size in the demo specs is 1024.
MAX_ROWS_PER_REQUEST = 4096

# Candidates in one ranking request (each becomes a row; the request path splits them into chunks
# of the model's max_batch_size). Matches client/ranking.py's DEFAULT_MAX_CANDIDATES.
MAX_CANDIDATES = 2000

# Bytes of one input tensor as sent (rows x features x dtype size). 4096 rows of 256 float32
# features is 4 MiB; 16 MiB leaves room for wider models without letting one call pin the server.
MAX_TENSOR_BYTES = 16 * 1024 * 1024

# Bytes of one gRPC message either way (all tensors of a request, or a response, plus framing). The
# client's channel refuses larger messages; Triton's HTTP frontend is set to the same bound.
MAX_MESSAGE_BYTES = 4 * MAX_TENSOR_BYTES


def check_rows(rows: int, *, what: str = "rows") -> None:
    """Raise RequestValidationError when a request carries more rows than MAX_ROWS_PER_REQUEST."""
    from scorestack.errors import RequestValidationError

    if rows > MAX_ROWS_PER_REQUEST:
        raise RequestValidationError(what, f"{rows} rows exceed the limit of {MAX_ROWS_PER_REQUEST} per request (scorestack.limits.MAX_ROWS_PER_REQUEST); split the request")


def check_candidates(n: int, *, limit: int = MAX_CANDIDATES) -> None:
    """Raise RequestValidationError when a ranking request has more candidates than allowed."""
    from scorestack.errors import RequestValidationError

    if n > min(limit, MAX_CANDIDATES):
        raise RequestValidationError("candidate_ids", f"{n} candidates exceed the limit of {min(limit, MAX_CANDIDATES)} (scorestack.limits.MAX_CANDIDATES); split the request")


def check_tensor_bytes(name: str, nbytes: int) -> None:
    """Raise RequestValidationError naming the tensor when it is larger than MAX_TENSOR_BYTES."""
    from scorestack.errors import RequestValidationError

    if nbytes > MAX_TENSOR_BYTES:
        raise RequestValidationError(name, f"{nbytes} bytes exceed the limit of {MAX_TENSOR_BYTES} per tensor (scorestack.limits.MAX_TENSOR_BYTES); send fewer rows per request")
