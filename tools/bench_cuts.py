"""Benchmark: generation cuts -- resolving a continuation at admission, and serving a cut.

(a) ``begin_call`` of a replacement call (attempt 1) continuing a cut call whose durable
    prefix was staged in 4 chunks totalling 32,768 delta tokens (the first chunk is the
    cumulative prefix record with the carried prompt; then three generation-only chunks),
    resolved from the log: fetch and verify the chunks, rebuild and hash the cumulative
    snapshot, check it, append the admission event (a store at durability="full"; the
    admission itself holds no tokens and commits without an fsync).
    Baseline: one ``hashlib.sha256`` pass over that cumulative record's digest preimage
    (16 bytes per token plus a header).  Target (issue): <= 6x, the median of per-round
    ratios over alternating blocks.  Also measured, in the same rounds: the resolve and
    fetch steps, and the floor of the admission's write -- the same event row appended
    with raw sqlite3 at the same page size and pragmas -- and, for context, the disk's fsync.

    ``begin_call`` appends an admission event but stages nothing, so the same admission is
    admitted repeatedly (checked: every repetition resolves the same 32,768-token prefix).

(b) ``serve_generation_cut`` for one inventory naming 64 live calls of 4,096 delta tokens
    each (10% carried prompt, the rest observed), then a second cut after 256 more tokens
    per call.  No target: total and per-call times are reported.

(c) What a call's chunk count costs every later cut: one live call cut every 16 tokens, each
    cut adding a chunk (as a periodic flush adds one), so its acknowledgement lists one more
    staging key each time (Gym's ack names every key of the prefix).  The cut's wall time and
    the receipt's JSON size are reported at 8, 64, 256, 1,024 and 2,048 keys (the median of
    the 8 cuts up to each).  No target: it tells a worker author how coarse to flush.

    .venv/bin/python tools/bench_cuts.py [--quick] [--json] [--profile] [--only a|b|c]
"""

from __future__ import annotations

import gc
import hashlib
import os
import sqlite3
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    fsync_seconds,
    parser,
    profiled,
    staging_preimage,
    temp_dir,
)

from store import (
    CaptureAdmission,
    GenerationCutContinuation,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutReceipt,
    RolloutTokenCapture,
    Store,
    TokenIds,
    capture_key,
    open_store,
    to_json,
)
from store.log.events import EventKind
from store.worker.capture import _admission_body as admission_body
from store.worker.resolve import resolve_continuation

VOCAB = 150_000
TARGET_RATIO = 6.0
WEIGHT_VERSION = 7

# (a): a parent root call, then the cut call continuing it.
PARENT_PROMPT, PARENT_GENERATED = 256, 256
CUT_TOKENS, CUT_CHUNKS = 32_768, 4
CARRY_FRACTION = 0.10

# (b)
LIVE_CALLS, LIVE_TOKENS, MORE_TOKENS = 64, 4_096, 256


def ids(rng: np.random.Generator, count: int) -> list[int]:
    return rng.integers(0, VOCAB, size=count).tolist()


def logprobs(rng: np.random.Generator, count: int) -> list[float]:
    return (-rng.exponential(0.7, size=count) - 1e-6).tolist()


# --- (a) continuation resolved from the log --------------------------------------------------


@dataclass
class ContinuationSetup:
    store: Store
    capture: RolloutTokenCapture
    admission: CaptureAdmission
    continuation: GenerationCutContinuation
    prefix: TokenIds
    chunk_sizes: list[int]
    preimage: bytes


def setup_continuation(path: str, rng: np.random.Generator) -> ContinuationSetup:
    store = open_store(path, durability="full")
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: WEIGHT_VERSION)
    root = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c0", mode="text"))
    coords = capture.complete_call(
        root,
        prompt_token_ids=ids(rng, PARENT_PROMPT),
        generated_token_ids=ids(rng, PARENT_GENERATED),
        generated_logprobs=logprobs(rng, PARENT_GENERATED),
    )
    assert coords.disposition == "staged" and coords.staging_key is not None and coords.chain_hash is not None
    parent_tokens = store.fetch([coords.staging_key])[0].token_ids_delta.tolist()
    prev_len = len(parent_tokens)

    lineage: dict[str, Any] = {
        "model_call_id": "c1",
        "mode": "token_in",
        "parent_call_id": "c0",
        "prev_len": prev_len,
        "required_prefix_token_ids": parent_tokens,
        "parent_chain_hash": coords.chain_hash,
    }
    call = capture.begin_call(CaptureAdmission(rollout_id="r0", **lineage))
    carry = int(CUT_TOKENS * CARRY_FRACTION)
    capture.track(call, prompt_token_ids=parent_tokens + ids(rng, carry), effective_output_limit=2 * CUT_TOKENS)
    chunk = CUT_TOKENS // CUT_CHUNKS
    generated_sizes = [chunk - carry] + [chunk] * (CUT_CHUNKS - 1)
    ticket = GenerationCutPrefix(ticket_id="t1", rollout_id="r0", attempt_index=0, model_call_id="c1", admitted_at=1.0)
    receipt: GenerationCutReceipt | None = None
    for index, size in enumerate(generated_sizes):
        capture.observe(call, ids(rng, size), logprobs(rng, size))
        inventory = GenerationCutInventory.build(
            checkpoint_id=f"checkpoint-{index + 1}", server_name="policy", active_prefixes=[ticket]
        )
        receipt = capture.serve_generation_cut(inventory)
    assert receipt is not None
    ack = receipt.prefixes[0]
    assert ack.disposition == "durable_prefix" and len(ack.staging_keys) == CUT_CHUNKS, ack
    assert ack.prefix_digest is not None and ack.prefix_token_count is not None
    assert ack.effective_output_limit is not None
    continuation = GenerationCutContinuation(
        source_capture_key="r0",
        source_model_call_id="c1",
        staging_keys=ack.staging_keys,
        generation_token_count=ack.prefix_token_count,
        digest=ack.prefix_digest,
        effective_output_limit=ack.effective_output_limit,
    )
    admission = CaptureAdmission(rollout_id=capture_key("r0", 1), generation_cut=continuation, **lineage)
    chunks = store.fetch(list(ack.staging_keys))
    chunk_sizes = [chunk.delta_len for chunk in chunks]

    # The baseline's bytes: the cumulative record's staging-digest preimage.
    first = capture.begin_call(admission)
    cut = first.generation_cut
    assert cut is not None
    cut_columns = cut.columns
    columns = Columns(
        np.asarray(cut_columns.token_ids.array),
        np.asarray(cut_columns.token_mask.array),
        np.asarray(cut_columns.log_probs.array),
        carry,
    )
    preimage = staging_preimage(
        rollout_id=cut.rollout_id,
        model_call_id=cut.model_call_id,
        parent_call_id=cut.parent_call_id,
        mode=cut.mode,
        prev_len=cut.prev_len,
        weight_version=cut.weight_version,
        columns=columns,
        chain_hash=cut.chain_hash,
        cumulative_hash=cut.cumulative_hash,
    )
    if hashlib.sha256(preimage).hexdigest() != continuation.digest:
        raise AssertionError("the reconstructed preimage does not hash to the continuation digest")
    prefix = TokenIds.coerce(parent_tokens)
    return ContinuationSetup(store, capture, admission, continuation, prefix, chunk_sizes, preimage)


class RawAdmissionFloor:
    """The same admission event row appended with raw ``sqlite3``: one transaction per row, in a
    fresh file with the store's ``events`` table, page size and pragmas, committed the way the
    store commits an admission (WAL, ``synchronous=NORMAL``: an admission holds no tokens, so
    its commit does not wait for the disk)."""

    def __init__(self, store_path: str, folder: str) -> None:
        source = sqlite3.connect(f"file:{store_path}?mode=ro", uri=True)
        try:
            ddl = [
                sql
                for (sql,) in source.execute(
                    "SELECT sql FROM sqlite_master WHERE tbl_name = 'events' AND sql IS NOT NULL ORDER BY type DESC"
                )
            ]
            page_size = source.execute("PRAGMA page_size").fetchone()[0]
            cursor = source.execute(
                "SELECT * FROM events WHERE kind = ? ORDER BY seq DESC LIMIT 1", (EventKind.CALL_ADMITTED.value,)
            )
            names = [column[0] for column in cursor.description]
            row = dict(zip(names, cursor.fetchone(), strict=True))
        finally:
            source.close()
        row.pop("seq")
        self.row = row
        self.size = sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in row.values() if v is not None)
        self.connection = sqlite3.connect(os.path.join(folder, "raw-admission.db"), isolation_level=None)
        c = self.connection
        c.execute(f"PRAGMA page_size = {page_size}")
        c.execute("PRAGMA auto_vacuum = INCREMENTAL")
        c.execute("PRAGMA journal_mode = WAL")
        c.execute("PRAGMA synchronous = NORMAL")
        for sql in ddl:
            c.execute(sql)
        self.insert = f"INSERT INTO events ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})"
        self.version = int(row["stream_version"])

    def append(self) -> None:
        self.version += 1  # each append is the stream's next version, as in the store
        self.row["stream_version"] = self.version
        c = self.connection
        c.execute("BEGIN IMMEDIATE")
        c.execute(self.insert, tuple(self.row.values()))
        c.execute("COMMIT")

    def close(self) -> None:
        self.connection.close()


def bench_continuation(report: Report, args: Any, folder: str, rng: np.random.Generator) -> None:
    rounds = args.rounds or (5 if args.quick else 41)
    block_seconds = 0.005 if args.quick else 0.01
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    path = os.path.join(folder, "continuation.db")
    setup = setup_continuation(path, rng)
    store, capture, admission = setup.store, setup.capture, setup.admission
    expected = (CUT_TOKENS, setup.continuation.digest)
    admitted: list[tuple[int, str]] = []
    last: list[Any] = [None]

    def begin() -> None:
        # Only what verifies the admission is kept, and the latest call: a worker holds one live
        # call per continuation, while keeping every repetition's 32,768-token prefix alive
        # would time the growth of this process's heap instead.  (``call.continuation``, the
        # engine's view of the restored prefix, is built on first use: checked after timing.)
        call = capture.begin_call(admission)
        cut = call.generation_cut
        if cut is None:
            raise AssertionError("a repeated begin_call did not resolve the cut")
        admitted.append((cut.delta_len, cut.digest))
        last[0] = call

    def resolve() -> None:
        resolve_continuation(store, admission, setup.continuation, setup.prefix, WEIGHT_VERSION)

    keys = list(setup.continuation.staging_keys)

    def fetch() -> None:
        store.fetch(keys)

    def sha() -> None:
        hashlib.sha256(setup.preimage).hexdigest()

    body = admission_body(capture.begin_call(admission))

    def admission_write() -> None:
        store.record_admission(admission.rollout_id, admission.model_call_id, body)

    def call_lookup() -> None:
        store.call(admission.rollout_id, admission.model_call_id)

    raw = RawAdmissionFloor(path, folder)
    sides: dict[str, Callable[[], Any]] = {
        "sha256": sha,
        "begin_call": begin,
        "resolve_continuation": resolve,
        "fetch": fetch,
        "call_lookup": call_lookup,
        "admission_write": admission_write,
        "raw_admission": raw.append,
    }
    # Blocks of equal duration on every side: a process descheduled for a few milliseconds
    # (the machine is shared) then lands in each side's blocks alike.
    numbers = {name: calibrate(fn, block_seconds) for name, fn in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for fn in sides.values():
            fn()  # warm up
        for index in range(rounds):
            names = list(sides)
            names = names[index % len(names) :] + names[: index % len(names)]
            for name in names:
                gc.disable()
                try:
                    start = clock()
                    for _ in range(numbers[name]):
                        sides[name]()
                    times[name].append((clock() - start) / numbers[name])
                finally:
                    gc.enable()
        if any(entry != expected for entry in admitted):
            raise AssertionError("a repeated begin_call did not resolve the same prefix")
        continuation = last[0].continuation
        if continuation is None or continuation.generation_token_count != setup.continuation.generation_token_count:
            raise AssertionError("the admitted call lost the continuation's generated count")
        info = store.call(capture_key("r0", 1), "c1")
        if args.profile:
            with profiled(10):
                for _ in range(30):
                    begin()
    finally:
        store.close()
        raw.close()
    fsync = fsync_seconds(folder, samples=32)

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    base = times["sha256"]
    per_round = {name: [t / b for t, b in zip(values, base, strict=True)] for name, values in times.items()}
    ratio = statistics.median(per_round["begin_call"])
    report.params["a"] = (
        f"{CUT_TOKENS} delta tokens in {CUT_CHUNKS} chunks {setup.chunk_sizes}, prev_len {len(setup.prefix)}, "
        f"{setup.continuation.generation_token_count} generated; "
        f"{rounds} rounds of alternating blocks of {block_seconds * 1e3:g} ms, {args.clock} clock"
    )
    labels = {
        "sha256": f"sha256 of the cumulative preimage ({len(setup.preimage):,} B)",
        "begin_call": "begin_call (resolve + checks + admission commit)",
        "resolve_continuation": "  resolve_continuation (fetch + concat + 3 hashes)",
        "fetch": f"    store.fetch of the {CUT_CHUNKS} chunks (checksum, decode, verify)",
        "call_lookup": "  store.call: is the call already finished? (one calls-row lookup)",
        "admission_write": "  store.record_admission: the admission event's write",
        "raw_admission": f"    floor: that event row ({raw.size} B) appended with raw sqlite3, same pragmas",
    }
    report.table(
        "(a) begin_call of a continued call resolved from the log (ratio: median (min-max) of per-round ratios)",
        ["operation", "median time", "ratio to sha256"],
        [[labels[name], fmt_seconds(statistics.median(times[name])), spread(per_round[name])] for name in sides],
    )
    report.results["a"] = {
        "chunk_delta_tokens": setup.chunk_sizes,
        "preimage_bytes": len(setup.preimage),
        "seconds": times,
        "ratios": per_round,
        "ratio_median": ratio,
        "fsync_4k_median_s": fsync,
        "repeated_admissions_verified": len(admitted),
        "replacement_call_state": info.state if info else None,
    }
    report.notes.append(
        f"(a) {len(admitted)} repeated begin_calls of the same admission each resolved the same "
        f"{CUT_TOKENS}-token prefix (delta length and digest; the last call's continuation checked after timing)"
    )
    report.notes.append(
        f"(a) the admission commit does not fsync (durable=False: it holds no tokens); for context, "
        f"this disk's 4 KiB write+fsync median: {fmt_seconds(fsync)}"
    )
    report.targets.append(
        Target("cuts_begin_call_continuation_32768", ratio, "<=", TARGET_RATIO, note=spread(per_round["begin_call"]))
    )


# --- (b) serving a cut of 64 live calls --------------------------------------------------------


def one_serve_round(path: str, rng: np.random.Generator) -> tuple[float, float, float]:
    """Returns (seconds of the first cut, seconds of the second cut, sha256 seconds of all prefixes)."""
    store = open_store(path, durability="full")
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: WEIGHT_VERSION)
    try:
        carry = int(LIVE_TOKENS * CARRY_FRACTION)
        calls, tickets = [], []
        for index in range(LIVE_CALLS):
            call = capture.begin_call(CaptureAdmission(rollout_id=f"r{index}", model_call_id="c0", mode="text"))
            capture.track(call, prompt_token_ids=ids(rng, carry), effective_output_limit=2 * LIVE_TOKENS)
            capture.observe(call, ids(rng, LIVE_TOKENS - carry), logprobs(rng, LIVE_TOKENS - carry))
            calls.append(call)
            tickets.append(
                GenerationCutPrefix(
                    ticket_id=f"t{index:03d}",
                    rollout_id=f"r{index}",
                    attempt_index=0,
                    model_call_id="c0",
                    admitted_at=1.0,
                )
            )

        def serve(checkpoint: str, expect: int) -> float:
            inventory = GenerationCutInventory.build(
                checkpoint_id=checkpoint, server_name="policy", active_prefixes=tickets
            )
            start = time.perf_counter()
            receipt = capture.serve_generation_cut(inventory)
            elapsed = time.perf_counter() - start
            counts = {ack.prefix_token_count for ack in receipt.prefixes}
            if len(receipt.prefixes) != LIVE_CALLS or counts != {expect}:
                raise AssertionError(f"cut {checkpoint}: unexpected acknowledgements {counts}")
            return elapsed

        first = serve("checkpoint-1", LIVE_TOKENS - carry)
        for call in calls:
            capture.observe(call, ids(rng, MORE_TOKENS), logprobs(rng, MORE_TOKENS))
        second = serve("checkpoint-2", LIVE_TOKENS - carry + MORE_TOKENS)
    finally:
        store.close()
    # For scale: one sha256 over 64 preimage-sized buffers of 4,096 tokens.
    blob = os.urandom(16 * LIVE_TOKENS + 200)
    start = time.perf_counter()
    for _ in range(LIVE_CALLS):
        hashlib.sha256(blob).digest()
    return first, second, time.perf_counter() - start


def bench_serve(report: Report, args: Any, folder: str, rng: np.random.Generator) -> None:
    repeat = 1 if args.quick else 5
    firsts, seconds, hashes = [], [], []
    for rep in range(repeat):
        first, second, sha = one_serve_round(os.path.join(folder, f"serve-{rep}.db"), rng)
        firsts.append(first)
        seconds.append(second)
        hashes.append(sha)
    report.params["b"] = f"{LIVE_CALLS} live calls x {LIVE_TOKENS} delta tokens, +{MORE_TOKENS} each, repeat {repeat}"

    def row(name: str, values: list[float]) -> list[str]:
        median = statistics.median(values)
        return [name, fmt_seconds(median), fmt_seconds(min(values)), fmt_seconds(median / LIVE_CALLS)]

    report.table(
        f"(b) serve_generation_cut, one inventory of {LIVE_CALLS} live calls (fresh store per repetition)",
        ["operation", "total median", "total min", "per call (median)"],
        [
            row(f"first cut ({LIVE_TOKENS} tokens per call)", firsts),
            row(f"second cut (+{MORE_TOKENS} tokens per call)", seconds),
            row("for scale: sha256 of 64 x 4,096-token preimages", hashes),
        ],
    )
    report.results["b"] = {
        "first_cut_s": firsts,
        "second_cut_s": seconds,
        "first_cut_median_per_call_s": statistics.median(firsts) / LIVE_CALLS,
        "second_cut_median_per_call_s": statistics.median(seconds) / LIVE_CALLS,
        "sha256_64_preimages_s": hashes,
    }


# --- (c) a cut's cost as the call's chunks accumulate -------------------------------------------

KEY_MARKS = (8, 64, 256, 1024, 2048)
TOKENS_PER_CUT = 16


def bench_keys(report: Report, args: Any, folder: str, rng: np.random.Generator) -> None:
    marks = KEY_MARKS[:3] if args.quick else KEY_MARKS
    with open_store(os.path.join(folder, "keys.db"), durability="full") as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: WEIGHT_VERSION)
        try:
            call = capture.begin_call(CaptureAdmission(rollout_id="r-keys", model_call_id="c0", mode="text"))
            capture.track(call, prompt_token_ids=ids(rng, 16), effective_output_limit=TOKENS_PER_CUT * marks[-1])
            ticket = GenerationCutPrefix(
                ticket_id="t0", rollout_id="r-keys", attempt_index=0, model_call_id="c0", admitted_at=1.0
            )
            window: list[tuple[float, int]] = []
            rows = []
            for cut in range(1, marks[-1] + 1):
                capture.observe(call, ids(rng, TOKENS_PER_CUT), logprobs(rng, TOKENS_PER_CUT))
                inventory = GenerationCutInventory.build(
                    checkpoint_id=f"k{cut}", server_name="policy", active_prefixes=[ticket]
                )
                start = time.perf_counter()
                receipt = capture.serve_generation_cut(inventory)
                window.append((time.perf_counter() - start, len(to_json(receipt))))
                (ack,) = receipt.prefixes
                if len(ack.staging_keys) != cut or ack.prefix_token_count != cut * TOKENS_PER_CUT:
                    raise AssertionError(f"cut {cut}: {len(ack.staging_keys)} keys, {ack.prefix_token_count} tokens")
                if cut in marks:
                    last = window[-8:]
                    rows.append((cut, statistics.median(t for t, _ in last), last[-1][1]))
        finally:
            capture.close()
    report.table(
        f"(c) a cut of one live call holding N chunks (a cut every {TOKENS_PER_CUT} tokens; median of 8 cuts)",
        ["staging keys in its ack", "cut wall time", "receipt JSON"],
        [[f"{keys:,}", fmt_seconds(seconds), f"{size:,} B"] for keys, seconds, size in rows],
    )
    report.results["c"] = [{"keys": keys, "cut_s": seconds, "receipt_bytes": size} for keys, seconds, size in rows]


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--profile", action="store_true", help="cProfile 30 begin_calls of (a), top 10 to stderr")
    p.add_argument("--only", choices=("a", "b", "c"), default=None, help="run only part (a), (b) or (c)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds of (a) (default 41, --quick 5)")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="wall",
        help="time (a)'s blocks by the wall clock (default) or by this process's CPU time (every side alike; "
        "it leaves out waits for a core, and for the disk)",
    )
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    report = Report("bench_cuts")
    parts: list[Callable[[Report, Any, str, np.random.Generator], None]] = []
    if args.only in (None, "a"):
        parts.append(bench_continuation)
    if args.only in (None, "b"):
        parts.append(bench_serve)
    if args.only in (None, "c"):
        parts.append(bench_keys)
    with temp_dir(args.dir) as folder:
        for part in parts:
            part(report, args, folder, rng)
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
