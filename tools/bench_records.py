"""Benchmark: build and validate a staged record, against one SHA-256 pass over its digest preimage.

A worker builds each record with ``StagedCallRecord.from_components`` (validate, pack and
hash in one pass) and then reads it back (``record.columns``, ``record.digest``).  The
floor is hashing the staging-digest preimage once: ``hashlib.sha256`` over the same
encoded bytes (about 16 bytes per token plus a header), measured in the same run.

Input forms measured (as a worker capture may hold the columns):

* ``list``   -- Python lists of ints / floats;
* ``numpy``  -- numpy arrays: uint64 ids, float64 log-probs, float64 mask;
* ``array``  -- ``array.array`` buffers ('Q' ids, 'd' log-probs and mask), as the live-call
  buffers of ``store/cuts.py``.

Target (issue): (build + validate) / sha256 <= 3x, per input form and record size.

Chain and cumulative hashes are inputs of ``from_components`` and are computed once,
outside the timed region (the builders of ``store/capture.py`` compute them separately).

    .venv/bin/python tools/bench_records.py [--quick] [--json] [--profile]
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import (
    Columns,
    Report,
    Target,
    calibrate,
    fmt_seconds,
    make_columns,
    measure,
    parser,
    profiled,
    staging_preimage,
)

from store import StagedCallRecord, compute_chain_hash, hash_token_ids
from store.digest import is_digest_hex

TARGET_RATIO = 3.0
SIZES = (4_096, 32_768)
FORMS = ("list", "numpy", "array")
ROLLOUT_ID = "rollout-000042"
MODEL_CALL_ID = "call-0003"
WEIGHT_VERSION = 7


def inputs(columns: Columns, form: str) -> tuple[Any, Any, Any]:
    """The three columns in the given input form (ids, mask, log-probs)."""
    if form == "list":
        return columns.ids.tolist(), columns.mask.tolist(), columns.logprobs.tolist()
    if form == "numpy":
        return columns.ids.copy(), columns.mask.copy(), columns.logprobs.copy()
    if form == "array":
        return (
            array.array("Q", columns.ids.tobytes()),
            array.array("d", columns.mask.tobytes()),
            array.array("d", columns.logprobs.tobytes()),
        )
    raise ValueError(form)


def builder(columns: Columns, form: str) -> tuple[Callable[[], StagedCallRecord], Callable[[StagedCallRecord], None]]:
    ids, mask, logprobs = inputs(columns, form)
    chain_hash = compute_chain_hash(None, columns.ids)
    cumulative_hash = hash_token_ids(columns.ids)
    count = len(columns)

    def build() -> StagedCallRecord:
        return StagedCallRecord.from_components(
            rollout_id=ROLLOUT_ID,
            model_call_id=MODEL_CALL_ID,
            parent_call_id=None,
            mode="text",
            prev_len=0,
            weight_version=WEIGHT_VERSION,
            token_ids_delta=ids,
            token_mask_delta=mask,
            generation_log_probs_delta=logprobs,
            chain_hash=chain_hash,
            cumulative_hash=cumulative_hash,
        )

    def validate(record: StagedCallRecord) -> None:
        # from_components already ran every structural check and computed the digest;
        # "validating" the built record is reading it back, without hashing again.
        cols = record.columns
        if not is_digest_hex(record.digest):
            raise AssertionError("digest is not 64 lowercase hex characters")
        if not (len(cols.token_ids) == len(cols.token_mask) == len(cols.log_probs) == record.delta_len == count):
            raise AssertionError("column lengths differ from delta_len")
        if record.cum_len != record.prev_len + record.delta_len:
            raise AssertionError("cum_len != prev_len + delta_len")

    return build, validate


def preimage(columns: Columns) -> bytes:
    return staging_preimage(
        rollout_id=ROLLOUT_ID,
        model_call_id=MODEL_CALL_ID,
        parent_call_id=None,
        mode="text",
        prev_len=0,
        weight_version=WEIGHT_VERSION,
        columns=columns,
        chain_hash=compute_chain_hash(None, columns.ids),
        cumulative_hash=hash_token_ids(columns.ids),
    )


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--profile", action="store_true", help="cProfile build+validate (list form, 4096) to stderr")
    args = p.parse_args()
    repeat = 7 if args.quick else 41
    min_sample = 0.002 if args.quick else 0.01
    rng = np.random.default_rng(args.seed)

    report = Report("bench_records", params={"sizes": list(SIZES), "forms": list(FORMS), "repeat": repeat})
    rows = []
    for size in SIZES:
        columns = make_columns(rng, size)
        data = preimage(columns)

        # Sanity: the preimage built here is the one the store hashes.
        build0, _ = builder(columns, "numpy")
        if hashlib.sha256(data).hexdigest() != build0().digest:
            report.notes.append(f"size {size}: the reconstructed preimage does not hash to the store's digest")

        def sha(data: bytes = data) -> str:
            return hashlib.sha256(data).hexdigest()

        base = measure(sha, repeat=repeat, number=calibrate(sha, min_sample), warmup=3)
        report.results[f"sha256_{size}"] = {"preimage_bytes": len(data), **base.as_dict()}
        rows.append(
            [f"sha256 preimage ({len(data):,} B)", size, fmt_seconds(base.median), fmt_seconds(base.min), "1.00x", ""]
        )

        for form in FORMS:
            build, validate = builder(columns, form)
            record = build()
            validate(record)

            def both(build: Callable[[], StagedCallRecord] = build, validate: Any = validate) -> None:
                validate(build())

            timing = measure(both, repeat=repeat, number=calibrate(both, min_sample), warmup=3)
            build_only = measure(build, repeat=repeat, number=calibrate(build, min_sample), warmup=1)

            def check(validate: Any = validate, record: StagedCallRecord = record) -> None:
                validate(record)

            validate_only = measure(check, repeat=repeat, number=calibrate(check, min_sample), warmup=1)
            ratio = timing.median / base.median
            report.results[f"{form}_{size}"] = {
                "build_validate": timing.as_dict(),
                "build_only": build_only.as_dict(),
                "validate_only": validate_only.as_dict(),
                "ratio_median": ratio,
                "ratio_min": timing.min / base.min,
            }
            rows.append(
                [
                    f"from_components + validate [{form}]",
                    size,
                    fmt_seconds(timing.median),
                    fmt_seconds(timing.min),
                    f"{ratio:.2f}x",
                    f"build {fmt_seconds(build_only.median)}, validate {fmt_seconds(validate_only.median)}",
                ]
            )
            report.targets.append(Target(f"records_{size}_{form}", ratio, "<=", TARGET_RATIO))
    report.table(
        "Per-record time (median / min of repeats; ratio = median / sha256 median)",
        ["operation", "tokens", "median", "min", "ratio", "split (medians)"],
        rows,
    )
    report.notes.append("records_<tokens>_<form> targets: median(build+validate) / median(sha256 of the preimage)")
    report.notes.append("inputs: ~10% carried prompt (mask 0.0), then generated tokens; ids < 150,000")
    report.emit(args.json)

    if args.profile:
        build, validate = builder(make_columns(rng, SIZES[0]), "list")
        with profiled(10):
            for _ in range(300):
                validate(build())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
