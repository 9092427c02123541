"""Every size, length, character set and number range the manager accepts, in one place.

The same rules hold whichever store sits behind the manager: they are checked at the edge (REST
bodies and parameters, gRPC messages, spec files) before anything reaches SQLite or PostgreSQL, so
an over-long name, a NUL byte or a number past a column's range is a clear 4xx / INVALID_ARGUMENT
naming the field, never a database error. Lengths match the columns in `store/models.py`; integer
ranges match the column types (Integer is 32-bit signed, BigInteger 64-bit signed, on both stores).

Why these characters: identifiers (node, domain, GPU, worker ids) are printable ASCII without
spaces, which covers host names, NVML UUIDs and NVLink fabric ids ("<clusterUuid hex>/<clique>");
job names also travel in URL paths, so they are a stricter pattern without '/'. Free text (reasons,
token names, model names) may be any Unicode that UTF-8 can encode, minus control characters other
than tab and newline: PostgreSQL refuses NUL in text and lone surrogates cannot be encoded.
"""

from __future__ import annotations

import math
import re

# ---- lengths (characters; the matching columns are at least this long) --------------------------
JOB_NAME_MAX = 128
NODE_MAX = 253  # a DNS name
DOMAIN_MAX = 128
GPU_ID_MAX = 128
WORKER_ID_MAX = 128
TOKEN_NAME_MAX = 128
SHORT_TEXT_MAX = 128  # GPU model, boot id
VERSION_TEXT_MAX = 64  # agent version
REASON_MAX = 2000  # operator reasons, health reasons (each)
REASONS_PER_GPU = 16  # reasons in one GPU's health entry
XIDS_PER_GPU = 64  # XID events in one GPU's health entry

# ---- counts ------------------------------------------------------------------------------------
GPUS_PER_NODE_MAX = 128  # a hello's inventory; real nodes hold 4-16
RANKS_PER_STEP_REPORT = 1024  # ranks one worker reports in one call
SEQUENCES_PER_RANK = 65_536  # sequence lengths per rank in one step report
JOB_DOMAINS_MAX = 100_000
POWER_CURVE_POINTS_MAX = 64
# A job spec never asks for more GPUs than this, whatever the cluster: what the planner is
# benchmarked for (bench/RESULTS.md). The manager bounds it further by its `max_cluster_gpus`.
JOB_GPUS_MAX = 1_048_576

# ---- integer ranges ----------------------------------------------------------------------------
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
UNIT_COUNT_MAX = 2**31 - 1  # heads, MLP columns
TP_MAX = 4096  # larger than any NVLink domain built (NVL576)

# ---- patterns ----------------------------------------------------------------------------------
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
NODE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
IDENT_PATTERN = r"^[!-~]+$"  # printable ASCII, no spaces
TEXT_PATTERN = r"^[^\x00-\x08\x0b-\x1f\x7f]*$"  # no control characters but tab and newline
FINGERPRINT_PATTERN = r"^[0-9a-f]{64}$"

_RE = {p: re.compile(p) for p in (JOB_NAME_PATTERN, NODE_PATTERN, IDENT_PATTERN, TEXT_PATTERN, FINGERPRINT_PATTERN)}


class LimitError(ValueError):
    """A value breaks a limit; `field` names where it came from."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def _show(value: str) -> str:
    return repr(value[:40] + ("..." if len(value) > 40 else ""))


def text(field: str, value: str, max_len: int = REASON_MAX, *, allow_empty: bool = True) -> str:
    """Free text: at most `max_len` characters, encodable as UTF-8, no control characters."""
    if not value and not allow_empty:
        raise LimitError(field, "must not be empty")
    if len(value) > max_len:
        raise LimitError(field, f"is {len(value)} characters long; the limit is {max_len}")
    if not _RE[TEXT_PATTERN].fullmatch(value):
        raise LimitError(field, "contains a control character (NUL, escape, ...)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise LimitError(field, "is not valid Unicode (a lone surrogate)") from None
    return value


def ident(field: str, value: str, max_len: int, pattern: str = IDENT_PATTERN) -> str:
    """An identifier: non-empty, at most `max_len` characters, matching `pattern`."""
    if not value:
        raise LimitError(field, "must not be empty")
    if len(value) > max_len:
        raise LimitError(field, f"is {len(value)} characters long; the limit is {max_len}")
    if not _RE[pattern].fullmatch(value):
        raise LimitError(field, f"{_show(value)} does not match {pattern}")
    return value


def job_name(field: str, value: str) -> str:
    return ident(field, value, JOB_NAME_MAX, JOB_NAME_PATTERN)


def node_name(field: str, value: str) -> str:
    return ident(field, value, NODE_MAX, NODE_PATTERN)


def integer(field: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise LimitError(field, f"{value} is outside [{lo}, {hi}]")
    return value


def finite(field: str, value: float, lo: float = -math.inf, hi: float = math.inf) -> float:
    if not math.isfinite(value):
        raise LimitError(field, f"must be a finite number, got {value}")
    if not lo <= value <= hi:
        raise LimitError(field, f"{value} is outside [{lo:g}, {hi:g}]")
    return value


def fingerprint(field: str, value: str) -> str:
    """A SHA-256 certificate fingerprint; colons and upper case are accepted and normalised."""
    v = value.replace(":", "").lower()
    if not _RE[FINGERPRINT_PATTERN].fullmatch(v):
        raise LimitError(field, "must be the SHA-256 of a certificate: 64 hex digits (colons allowed)")
    return v


def cap_message(message: str, limit: int = 1000) -> str:
    """Error text sent to a client, cut to `limit` characters (gRPC trailers are small, ~8 KiB)."""
    return message if len(message) <= limit else message[: limit - 20] + " ... (truncated)"
