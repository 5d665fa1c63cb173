"""Shared helpers of the benchmark programs in ``tools/`` (not a test module).

Timing is ``time.perf_counter``; every measurement is repeated and reported as median and
min.  Each program prints a small table and one ``TARGET`` line per target, or JSON with
``--json``; ``--quick`` is a short smoke run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from store.wire.digest import (
    EMPTY_EXTRAS_DIGEST,
    EXTRAS_DIGEST_VERSION,
    STAGING_CALL_DOMAIN,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
)

VOCAB = 150_000
_U64 = struct.Struct(">Q").pack


# --- command line -------------------------------------------------------------------------


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--quick", action="store_true", help="a short run (smoke check)")
    p.add_argument("--seed", type=int, default=1234, help="random seed of the generated tokens")
    p.add_argument("--dir", default=None, help="folder for temporary databases (default: the system temp folder)")
    return p


@contextmanager
def temp_dir(base: str | None = None) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="staging-bench-", dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- timing -------------------------------------------------------------------------------


@dataclass
class Timing:
    """Per-call seconds of ``samples`` repetitions (each the mean of ``number`` calls)."""

    samples: list[float]
    number: int = 1

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    def as_dict(self) -> dict[str, Any]:
        return {
            "median_s": self.median,
            "min_s": self.min,
            "repeat": len(self.samples),
            "number": self.number,
        }


def measure(
    fn: Callable[[], Any],
    *,
    repeat: int,
    number: int = 1,
    warmup: int = 1,
    disable_gc: bool = True,
) -> Timing:
    """Time ``fn``: ``warmup`` untimed calls, then ``repeat`` samples of ``number`` calls each."""
    for _ in range(warmup):
        fn()
    gc.collect()
    enabled = gc.isenabled()
    if disable_gc:
        gc.disable()
    samples = []
    try:
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples.append((time.perf_counter() - start) / number)
    finally:
        if enabled:
            gc.enable()
    return Timing(samples, number)


def calibrate(fn: Callable[[], Any], min_sample: float) -> int:
    """How many calls of ``fn`` make one sample last at least ``min_sample`` seconds."""
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_sample or number >= 1 << 20:
            return number
        number = max(number * 2, int(number * min_sample / max(elapsed, 1e-9)) + 1)


def fmt_seconds(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


# --- targets and output -------------------------------------------------------------------


@dataclass
class Target:
    name: str
    measured: float
    op: str  # "<=" or ">="
    value: float
    unit: str = "x"
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.measured <= self.value if self.op == "<=" else self.measured >= self.value

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"TARGET {self.name}: measured {self.measured:.3f}{self.unit} "
            f"(target {self.op} {self.value:g}{self.unit}) {verdict}"
        )

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        return data


@dataclass
class Report:
    benchmark: str
    params: dict[str, Any] = field(default_factory=dict)
    tables: list[tuple[str, list[str], list[list[Any]]]] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.tables.append((title, list(header), [list(r) for r in rows]))

    def emit(self, as_json: bool) -> None:
        if as_json:
            print(
                json.dumps(
                    {
                        "benchmark": self.benchmark,
                        "params": self.params,
                        "environment": environment(),
                        "results": self.results,
                        "targets": [t.as_dict() for t in self.targets],
                        "notes": self.notes,
                    },
                    indent=2,
                )
            )
            return
        print(f"== {self.benchmark} ==")
        print("params: " + ", ".join(f"{k}={v}" for k, v in self.params.items()))
        for title, header, rows in self.tables:
            print()
            print(title)
            print_table(header, rows)
        for note in self.notes:
            print(f"note: {note}")
        print()
        for target in self.targets:
            print(target.line())


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for index, row in enumerate(cells):
        print(
            "  "
            + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        )
        if index == 0:
            print("  " + "  ".join("-" * w for w in widths))


def environment() -> dict[str, Any]:
    import sqlite3

    return {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "sqlite": sqlite3.sqlite_version,
        "cpus": os.cpu_count(),
    }


@contextmanager
def profiled(top: int = 10, sorts: Sequence[str] = ("cumulative", "tottime")) -> Iterator[None]:
    """Profile the block; print the ``top`` functions per sort order (to stderr: --json stays clean)."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        for sort in sorts:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).strip_dirs().sort_stats(sort).print_stats(top)
            print(out.getvalue(), file=sys.stderr)


# --- realistic token columns --------------------------------------------------------------


@dataclass
class Columns:
    """One call's delta: ``carry`` prompt tokens (mask 0.0, log-prob 0.0), then generated ones."""

    ids: np.ndarray  # uint64
    mask: np.ndarray  # float64
    logprobs: np.ndarray  # float64
    carry: int

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def generated(self) -> int:
        return len(self) - self.carry


def make_columns(rng: np.random.Generator, tokens: int, carry_fraction: float = 0.10) -> Columns:
    carry = int(tokens * carry_fraction)
    ids = rng.integers(0, VOCAB, size=tokens, dtype=np.uint64)
    mask = np.zeros(tokens, dtype=np.float64)
    mask[carry:] = 1.0
    logprobs = np.zeros(tokens, dtype=np.float64)
    # Log-probs of sampled tokens: negative, mostly small, binary32-representable or not.
    logprobs[carry:] = -rng.exponential(0.7, size=tokens - carry) - 1e-6
    return Columns(ids, mask, logprobs, carry)


def staging_preimage(
    *,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    weight_version: int,
    columns: Columns,
    chain_hash: str,
    cumulative_hash: str,
) -> bytes:
    """The bytes the staging digest hashes (wire-contract 2.6), built directly (big-endian)."""

    def text(value: str) -> bytes:
        raw = value.encode()
        return _U64(len(raw)) + raw

    count = len(columns)
    parts = [
        STAGING_CALL_DOMAIN,
        bytes((STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION)),
        text(rollout_id),
        text(model_call_id),
        b"\x00" if parent_call_id is None else b"\x01" + text(parent_call_id),
        text(mode),
        _U64(prev_len),
        _U64(count),
        _U64(prev_len + count),
        _U64(weight_version),
        _U64(8 + 8 * count) + _U64(count),
        columns.ids.astype(">u8").tobytes(),
        _U64(8 + 4 * count) + _U64(count),
        columns.mask.astype(">f4").tobytes(),
        _U64(8 + 4 * count) + _U64(count),
        columns.logprobs.astype(">f4").tobytes(),
        bytes.fromhex(EMPTY_EXTRAS_DIGEST),
        b"\x01" + bytes.fromhex(chain_hash),
        b"\x01" + bytes.fromhex(cumulative_hash),
    ]
    return b"".join(parts)


def file_size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def fsync_seconds(folder: str | None = None, samples: int = 16, *, data_only: bool = False) -> float:
    """Median time of one 4 KiB write + fsync (``fdatasync`` with ``data_only``) in ``folder``
    (default: the temp folder): the disk's current mood, sampled beside a benchmark's blocks."""
    fd, path = tempfile.mkstemp(prefix="fsync-probe-", dir=folder)
    sync = os.fdatasync if data_only else os.fsync
    times = []
    try:
        for index in range(samples):
            os.pwrite(fd, b"x" * 4096, index * 4096)
            start = time.perf_counter()
            sync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        os.remove(path)
    return statistics.median(times)
