"""Benchmark: the store-wide audit and replay over a store of N records of 4,096 tokens.

(a) ``Store.audit()`` vs a raw ``sqlite3`` read of the same stored rows plus one SHA-256
    pass over each record's digest preimage (rebuilt from the stored bytes).  Target: <= 2x.
    The same rounds also time a floor: that raw read and SHA-256 pass, plus what an audit
    that trusts nothing cannot skip: each row's xxh3 event checksum and body decoding, and
    the two other SHA-256 passes over each record's token ids (its chain hash and, for a
    root, its cumulative hash).  floor / baseline says how far the target is reachable.
    And SQLite's page walk (``PRAGMA quick_check``), which the audit runs, is timed alone in
    the same rounds: its share of an audit.
(b) ``Store.replay()`` vs a raw ``sqlite3`` read of the same rows.  Target: <= 2x.
    (tools/bench_replay.py measures replay in blocks, with its own floor.)

The machine is shared and noisy, so each round runs the thing and its baseline back to back
(alternating which goes first), each on a fresh connection; the per-round ratios are
reported as median, min and max, and the target is judged on the median.

    .venv/bin/python tools/bench_audit.py [--records N] [--rounds R] [--quick] [--json]
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Report, Target, fmt_seconds, make_columns, parser, temp_dir

from store import StagedCallRecord, StageEntry, compute_chain_hash, hash_token_ids, open_store
from store.log.checksum import CHECKSUMMED_COLUMNS, event_checksum
from store.wire.digest import (
    CHAIN_DOMAIN,
    CUMULATIVE_DOMAIN,
    EXTRAS_DIGEST_VERSION,
    STAGING_CALL_DOMAIN,
    STAGING_DIGEST_VERSION,
)

TOKENS = 4096
TARGET_RATIO = 2.0
_U64 = struct.Struct(">Q").pack


def build_store(path: str, records: int, seed: int, tokens: int = TOKENS, prefix: str = "rollout") -> None:
    rng = np.random.default_rng(seed)
    with open_store(path, durability="normal") as store:
        batch: list[StageEntry] = []
        for index in range(records):
            columns = make_columns(rng, tokens)
            ids = columns.ids
            record = StagedCallRecord.from_components(
                rollout_id=f"{prefix}-{index}",
                model_call_id="call-0",
                parent_call_id=None,
                mode="text",
                prev_len=0,
                weight_version=1,
                token_ids_delta=ids,
                token_mask_delta=columns.mask,
                generation_log_probs_delta=columns.logprobs,
                chain_hash=compute_chain_hash(None, ids),
                cumulative_hash=hash_token_ids(ids),
            )
            batch.append(StageEntry(record))
            if len(batch) == 100:
                store.stage_all(batch)
                batch = []
        if batch:
            store.stage_all(batch)


def _text(value: str) -> bytes:
    raw = value.encode()
    return _U64(len(raw)) + raw


def raw_read_and_hash(path: str) -> int:
    """Raw sqlite3: every stored row, and one SHA-256 pass over each record's digest preimage."""
    hashed = 0
    connection = sqlite3.connect(path)
    try:
        rows = connection.execute("SELECT body, token_ids, token_mask, log_probs FROM events ORDER BY seq")
        for body, ids, mask, log_probs in rows:
            if ids is None:
                continue
            fields = msgspec.msgpack.decode(body)
            _preimage_hash(fields, np.frombuffer(ids, dtype="<u4", offset=1).astype(">u8"), mask, log_probs)
            hashed += 1
    finally:
        connection.close()
    return hashed


EVENT_COLUMNS = ("seq", *CHECKSUMMED_COLUMNS, "checksum")  # every column of the log


def audit_floor(path: str) -> int:
    """The baseline's read and preimage hash, plus each row's checksum and body decoded, and the
    chain-hash and cumulative-hash passes over each (root) record's token ids."""
    hashed = 0
    connection = sqlite3.connect(path)
    decode = msgspec.msgpack.decode
    try:
        query = f"SELECT {', '.join(EVENT_COLUMNS)} FROM events ORDER BY seq"
        for row in connection.execute(query):
            values = dict(zip(EVENT_COLUMNS, row, strict=True))
            if event_checksum(values) != values["checksum"]:
                raise AssertionError(f"event {values['seq']} failed its checksum")
            fields = decode(values["body"])
            ids = values["token_ids"]
            if ids is None:
                continue
            ids_be = np.frombuffer(ids, dtype="<u4", offset=1).astype(">u8")
            count = len(ids_be)
            _preimage_hash(fields, ids_be, values["token_mask"], values["log_probs"])
            chain = hashlib.sha256(CHAIN_DOMAIN + b"\x00" + _U64(count))
            chain.update(ids_be.data)
            if chain.hexdigest() != fields["chain_hash"]:
                raise AssertionError("chain hash")
            cumulative = hashlib.sha256(CUMULATIVE_DOMAIN + _U64(count))
            cumulative.update(ids_be.data)
            if cumulative.hexdigest() != fields["cumulative_hash"]:
                raise AssertionError("cumulative hash")
            hashed += 1
    finally:
        connection.close()
    return hashed


def _preimage_hash(fields: dict[str, Any], ids_be: np.ndarray, mask: bytes, log_probs: bytes) -> str:
    count = len(ids_be)
    hasher = hashlib.sha256(STAGING_CALL_DOMAIN)
    hasher.update(bytes((fields["schema_version"], STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION)))
    hasher.update(_text(fields["rollout_id"]) + _text(fields["model_call_id"]) + b"\x00")
    hasher.update(_text(fields["mode"]))
    hasher.update(_U64(fields["prev_len"]) + _U64(count) + _U64(fields["cum_len"]))
    hasher.update(_U64(fields["weight_version"]) + _U64(8 + 8 * count) + _U64(count))
    hasher.update(ids_be.data)
    carry = int.from_bytes(mask[1:9], "big")
    header = _U64(8 + 4 * count) + _U64(count)
    hasher.update(header + b"\x00\x00\x00\x00" * carry + b"\x3f\x80\x00\x00" * (count - carry))
    hasher.update(header)
    hasher.update(memoryview(log_probs)[1:])
    hasher.update(bytes.fromhex(fields["extras_digest"]))
    hasher.update(b"\x01" + bytes.fromhex(fields["chain_hash"]))
    hasher.update(b"\x01" + bytes.fromhex(fields["cumulative_hash"]))
    digest = hasher.hexdigest()
    if digest != fields["digest"]:
        raise AssertionError("digest")
    return digest


def raw_read(path: str) -> int:
    """Raw sqlite3: every stored row of the log, every column."""
    seen = 0
    connection = sqlite3.connect(path)
    try:
        for row in connection.execute("SELECT * FROM events ORDER BY seq"):
            seen += len(row)
    finally:
        connection.close()
    return seen


def quick_check(path: str) -> None:
    """SQLite's page walk of the whole file, which the audit runs (PRAGMA quick_check), alone."""
    connection = sqlite3.connect(path)
    try:
        assert connection.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    finally:
        connection.close()


def store_audit(path: str) -> tuple[float, float]:
    """Wall and CPU seconds of one ``audit()`` on a freshly opened store (opening and migrating not timed)."""
    with open_store(path) as store:
        start, start_cpu = time.perf_counter(), time.process_time()
        report = store.audit()
        took, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    assert report.ok, report.summary()
    return took, cpu


def store_replay(path: str) -> tuple[float, float]:
    """Wall and CPU seconds of one ``replay()`` on a freshly opened store (opening and migrating not timed)."""
    with open_store(path) as store:
        start, start_cpu = time.perf_counter(), time.process_time()
        report = store.replay()
        took, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    assert report.ok, report.summary()
    return took, cpu


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - start_cpu


def rounds(
    thing: Callable[[], tuple[float, float]],
    baseline: Callable[[], Any],
    count: int,
    floor: Callable[[], Any] | None = None,
    part: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """``count`` rounds of thing (which times itself), baseline and (if given) floor back to
    back, rotating which goes first.  Wall and CPU seconds (of this process) are both kept:
    on a shared machine other processes stretch the wall time of whatever runs meanwhile."""
    steps: list[tuple[str, Callable[[], tuple[float, float]]]] = [
        ("thing", thing),
        ("baseline", lambda: _timed(baseline)),
    ]
    if floor is not None:
        steps.append(("floor", lambda: _timed(floor)))
    if part is not None:  # a piece of the thing, timed alone: its share of the thing
        steps.append(("part", lambda: _timed(part)))
    for _, step in steps:  # warm the page cache and the code paths
        step()
    times: dict[str, list[float]] = {name: [] for name, _ in steps}
    cpu: dict[str, list[float]] = {name: [] for name, _ in steps}
    for index in range(count):
        shift = index % len(steps)
        for name, step in steps[shift:] + steps[:shift]:
            wall, used = step()
            times[name].append(wall)
            cpu[name].append(used)
    ratios = [t / b for t, b in zip(times["thing"], times["baseline"], strict=True)]
    cpu_ratios = [t / b for t, b in zip(cpu["thing"], cpu["baseline"], strict=True)]
    result = {
        "thing_median_s": statistics.median(times["thing"]),
        "baseline_median_s": statistics.median(times["baseline"]),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "cpu_ratio_min": min(cpu_ratios),
        "cpu_ratio_max": max(cpu_ratios),
        "rounds": count,
    }
    if floor is not None:
        floors = [f / b for f, b in zip(times["floor"], times["baseline"], strict=True)]
        over = [t / f for t, f in zip(times["thing"], times["floor"], strict=True)]
        result |= {
            "floor_median_s": statistics.median(times["floor"]),
            "floor_ratio_median": statistics.median(floors),
            "floor_ratio_min": min(floors),
            "floor_ratio_max": max(floors),
            "thing_over_floor_median": statistics.median(over),
            "cpu_floor_ratio_median": statistics.median(
                [f / b for f, b in zip(cpu["floor"], cpu["baseline"], strict=True)]
            ),
        }
    if part is not None:
        shares = [p / t for p, t in zip(times["part"], times["thing"], strict=True)]
        result |= {
            "part_median_s": statistics.median(times["part"]),
            "part_share_median": statistics.median(shares),
            "part_ratio_median": statistics.median(
                [p / b for p, b in zip(times["part"], times["baseline"], strict=True)]
            ),
        }
    return result


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--records", type=int, default=None, help="records of 4,096 tokens (default 10,000; --quick 500)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per measurement (default 5; --quick 3)")
    args = p.parse_args()
    records = args.records or (500 if args.quick else 10_000)
    count = args.rounds or (3 if args.quick else 5)
    report = Report("audit", {"records": records, "tokens": TOKENS, "rounds": count})
    with temp_dir(args.dir) as folder:
        path = os.path.join(folder, "audit.db")
        started = time.perf_counter()
        build_store(path, records, args.seed)
        report.notes.append(f"built the store in {fmt_seconds(time.perf_counter() - started)}")
        audit = rounds(
            lambda: store_audit(path),
            lambda: raw_read_and_hash(path),
            count,
            lambda: audit_floor(path),
            lambda: quick_check(path),
        )
        replay = rounds(lambda: store_replay(path), lambda: raw_read(path), count)
    report.results = {"audit": audit, "replay": replay}
    rows = []
    for name, result, base in (("audit", audit, "raw read + SHA-256 of preimages"), ("replay", replay, "raw read")):
        rows.append(
            [
                name,
                fmt_seconds(result["thing_median_s"]),
                f"{base}: {fmt_seconds(result['baseline_median_s'])}",
                f"{result['ratio_median']:.2f}x ({result['ratio_min']:.2f}-{result['ratio_max']:.2f})",
            ]
        )
    rows.append(
        [
            "audit floor",
            fmt_seconds(audit["floor_median_s"]),
            "raw read + SHA-256 of preimages",
            f"{audit['floor_ratio_median']:.2f}x ({audit['floor_ratio_min']:.2f}-{audit['floor_ratio_max']:.2f})",
        ]
    )
    report.table(
        f"{records} records x {TOKENS} tokens", ["what", "median", "baseline median", "ratio median (min-max)"], rows
    )
    report.notes.append(f"audit / floor (median of rounds): {audit['thing_over_floor_median']:.2f}x")
    report.notes.append(
        f"PRAGMA quick_check alone: {fmt_seconds(audit['part_median_s'])}, "
        f"{audit['part_share_median']:.0%} of an audit, {audit['part_ratio_median']:.2f}x of the baseline"
    )
    for name, result in (("audit", audit), ("replay", replay)):
        report.notes.append(
            f"{name} CPU-time ratio (this process): {result['cpu_ratio_median']:.2f}x "
            f"({result['cpu_ratio_min']:.2f}-{result['cpu_ratio_max']:.2f})"
        )
    report.notes.append(f"audit floor CPU-time ratio: {audit['cpu_floor_ratio_median']:.2f}x")
    report.targets.append(Target(f"audit_{records}x{TOKENS}", audit["ratio_median"], "<=", TARGET_RATIO))
    report.targets.append(Target(f"replay_{records}x{TOKENS}", replay["ratio_median"], "<=", TARGET_RATIO))
    report.emit(args.json)
    return 0 if all(target.passed for target in report.targets) else 1


if __name__ == "__main__":
    sys.exit(main())
