"""Benchmark: bytes on disk per staged token (SQLite).

Stages a few hundred typical 4,096-token records (ids below 2**32, masks carry-then-
generation, ~10% carried prompt), closes the store, checkpoints and truncates the WAL
with a raw ``sqlite3`` connection, then divides the database file size by the tokens
staged.  The plain columns (u64 ids, f32 mask, f32 log-prob) take 16 bytes per token.

Target (issue): <= 9 bytes per token.  Also reports what each stored column takes per
token (``length()`` sums over the ``events`` table) and, when SQLite has ``dbstat``, the
pages of each table and index.

    .venv/bin/python tools/bench_bytes.py [--quick] [--json] [--records N]
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Report, Target, file_size, make_columns, parser, temp_dir

from store import StagedCallRecord, compute_chain_hash, hash_token_ids, open_store

TOKENS = 4_096
TARGET_BYTES = 9.0
PLAIN_BYTES = 16  # u64 id + f32 mask + f32 log-prob


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=None, help="records to stage (default 400; 50 with --quick)")
    args = p.parse_args()
    count = args.records or (50 if args.quick else 400)
    rng = np.random.default_rng(args.seed)

    report = Report("bench_bytes", params={"records": count, "tokens_per_record": TOKENS, "carry": "10%"})
    with temp_dir(args.dir) as folder:
        path = os.path.join(folder, "bytes.db")
        store = open_store(path, durability="full")
        tokens = 0
        try:
            for index in range(count):
                columns = make_columns(rng, TOKENS)
                record = StagedCallRecord.from_components(
                    rollout_id=f"rollout-{index:06d}",
                    model_call_id="call-0",
                    parent_call_id=None,
                    mode="text",
                    prev_len=0,
                    weight_version=7,
                    token_ids_delta=columns.ids,
                    token_mask_delta=columns.mask,
                    generation_log_probs_delta=columns.logprobs,
                    chain_hash=compute_chain_hash(None, columns.ids),
                    cumulative_hash=hash_token_ids(columns.ids),
                )
                result = store.stage(record)
                if not result.ok:
                    raise AssertionError(result.error)
                tokens += len(columns)
        finally:
            store.close()

        before = {"main": file_size(path), "wal": file_size(path + "-wal")}
        connection = sqlite3.connect(path)
        try:
            checkpoint = connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            page_size = connection.execute("PRAGMA page_size").fetchone()[0]
            page_count = connection.execute("PRAGMA page_count").fetchone()[0]
            freelist = connection.execute("PRAGMA freelist_count").fetchone()[0]
            sums = connection.execute(
                "SELECT count(*), sum(length(token_ids)), sum(length(token_mask)), sum(length(log_probs)), "
                "sum(length(body)), sum(length(checksum)) FROM events WHERE token_ids IS NOT NULL"
            ).fetchone()
            try:
                pages = connection.execute(
                    "SELECT name, count(*), sum(pgsize) FROM dbstat GROUP BY name ORDER BY sum(pgsize) DESC"
                ).fetchall()
            except sqlite3.OperationalError:
                pages = []
        finally:
            connection.close()
        main_size = file_size(path)
        wal_size = file_size(path + "-wal")

    on_disk = main_size + wal_size
    per_token = on_disk / tokens
    events, ids, mask, lps, body, checksum = sums
    columns_total = ids + mask + lps + body + checksum
    report.results.update(
        {
            "tokens": tokens,
            "records": events,
            "main_file_bytes": main_size,
            "wal_bytes_after_checkpoint": wal_size,
            "before_checkpoint": before,
            "checkpoint_result": list(checkpoint),
            "page_size": page_size,
            "page_count": page_count,
            "freelist_pages": freelist,
            "bytes_per_token": per_token,
            "column_bytes_per_token": {
                "token_ids": ids / tokens,
                "token_mask": mask / tokens,
                "log_probs": lps / tokens,
                "body": body / tokens,
                "checksum": checksum / tokens,
                "total": columns_total / tokens,
            },
            "dbstat": {name: {"pages": n, "bytes": size} for name, n, size in pages},
        }
    )
    report.table(
        "Database size",
        ["what", "bytes", "bytes/token"],
        [
            ["main file after wal_checkpoint(TRUNCATE)", f"{main_size:,}", f"{main_size / tokens:.3f}"],
            ["-wal file after checkpoint", f"{wal_size:,}", f"{wal_size / tokens:.3f}"],
            [f"(before checkpoint: main {before['main']:,} + wal {before['wal']:,})", "", ""],
            ["plain columns (u64 + f32 + f32), for reference", f"{PLAIN_BYTES * tokens:,}", f"{PLAIN_BYTES:.3f}"],
        ],
    )
    report.table(
        f"Stored column bytes per token ({events} record events, {tokens:,} tokens)",
        ["column", "bytes", "bytes/token"],
        [
            ["token_ids", f"{ids:,}", f"{ids / tokens:.3f}"],
            ["token_mask", f"{mask:,}", f"{mask / tokens:.3f}"],
            ["log_probs", f"{lps:,}", f"{lps / tokens:.3f}"],
            ["body (msgpack)", f"{body:,}", f"{body / tokens:.3f}"],
            ["checksum", f"{checksum:,}", f"{checksum / tokens:.3f}"],
            ["sum of columns", f"{columns_total:,}", f"{columns_total / tokens:.3f}"],
            [
                "file overhead (file - columns)",
                f"{on_disk - columns_total:,}",
                f"{(on_disk - columns_total) / tokens:.3f}",
            ],
        ],
    )
    if pages:
        report.table(
            "Pages per table / index (dbstat)",
            ["name", "pages", "bytes", "bytes/token"],
            [[name, n, f"{size:,}", f"{size / tokens:.3f}"] for name, n, size in pages],
        )
    report.targets.append(Target("bytes_per_token", per_token, "<=", TARGET_BYTES, unit=" B/token"))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
