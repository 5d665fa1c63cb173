"""A child-process writer for the transport's kill tests and benchmark (not a test module): it
drives Gym's put -> freeze -> drop cycle through ``TokenTransport`` until it is killed.

    python tests/transport_worker.py URL RUN_ID [--tasks T] [--calls C] [--ack-early]

``run_writer`` starts one, SIGKILLs it after a number of lines and returns them; ``lost`` reads
them back through a fresh client and names what is missing (the kill test and the benchmark).

Task ``t`` cycles through rollouts ``<RUN_ID>-t<t>-<n>``: it puts ``C`` entries (Gym's own
``TokenEntry``, stamped as Gym's capture stamps them), freezes the rollout and drops the
snapshot.  Each line is written and flushed only after the awaited call returned:

    PUT <rollout_id> <model_call_id> <sha256 of the entry's sorted JSON>
    FROZEN <rollout_id> <snapshot_id> <version>
    DROPPED <rollout_id>
    ERROR <text>

``--ack-early``: a broken writer that acknowledges its first entry without putting it (the
kill test's check must find it missing).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from nemo_gym.token_id_capture.lineage import stamp_continuation
from nemo_gym.token_id_capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage

from store import RolloutDroppedError, TokenTransport

REQUEST = [{"role": "user", "content": "What is the weather in Paris?"}]


def make_entry(rollout_id: str, model_call_id: str, seed: int, tokens: int = 64) -> TokenEntry:
    """A committed entry as Gym's capture builds it: prompt, generation, log-probs, lineage."""
    prompt = [(seed * 31 + i) % 50_000 for i in range(tokens)]
    generation = [(seed * 17 + i) % 50_000 for i in range(tokens // 2)]
    entry = TokenEntry(
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        model="transport-worker",
        prompt_token_ids=prompt,
        generation_token_ids=generation,
        generation_log_probs=[-0.1 - i / 1000 for i in range(len(generation))],
        output_items=[
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": str(seed)}]}
        ],
        token_item_index=0,
        created_at=1700000000.0 + seed,
    )
    stamp_continuation(entry, list(REQUEST))
    stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
    return entry


def entry_sha(entry: Any) -> str:
    """What a PUT line names: the SHA-256 of the entry's JSON with sorted keys."""
    return hashlib.sha256(json.dumps(entry.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def run_writer(url: str, run_id: str, *, acks: int, ack_early: bool = False) -> list[str]:
    """Start a writer process, let it acknowledge ``acks`` lines, SIGKILL it; its lines."""
    command = [sys.executable, str(Path(__file__).resolve()), url, run_id, "--tasks", "4", "--calls", "3"]
    if ack_early:
        command.append("--ack-early")
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        while len(lines) < acks and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            if not line.endswith("\n"):
                break  # torn by the kill: never acknowledged
            lines.append(line.strip())
    finally:
        child.send_signal(signal.SIGKILL)
        rest, errors = child.communicate(timeout=30)
    lines += rest.split("\n")[:-1]  # a line the kill tore (no newline yet) was never acknowledged
    if child.returncode != -signal.SIGKILL or any(line.startswith("ERROR") for line in lines) or len(lines) < acks:
        raise RuntimeError(f"the writer ended {child.returncode} after {len(lines)} lines: {errors[-2000:]}")
    return lines


def lost(url: str, lines: list[str]) -> list[str]:
    """What a fresh client in this process cannot read back of the writer's acknowledgements."""
    puts: dict[str, dict[str, str]] = {}
    frozen: dict[str, tuple[str, int]] = {}
    dropped: set[str] = set()
    for line in lines:
        kind, rollout_id, *rest = line.split()
        if kind == "PUT":
            puts.setdefault(rollout_id, {})[rest[0]] = rest[1]
        elif kind == "FROZEN":
            frozen[rollout_id] = (rest[0], int(rest[1]))
        elif kind == "DROPPED":
            dropped.add(rollout_id)
    problems: list[str] = []
    with TokenTransport.open(url) as reader:
        for rollout_id in sorted(set(puts) | set(frozen)):
            held = {entry.model_call_id: entry_sha(entry) for entry in reader.entries_now(rollout_id)}
            for call, sha in puts.get(rollout_id, {}).items():
                if held.get(call) != sha:
                    problems.append(f"{rollout_id}/{call}: acknowledged, {'different' if call in held else 'missing'}")
            try:
                snapshot = reader.freeze_now(rollout_id)
            except RolloutDroppedError:
                continue  # dropped (acknowledged or not: a drop is durable when it returns)
            if rollout_id in dropped:
                problems.append(f"{rollout_id}: acknowledged dropped, freezes again")
            elif rollout_id in frozen and (snapshot.snapshot_id, snapshot.version) != frozen[rollout_id]:
                problems.append(f"{rollout_id}: acknowledged snapshot {frozen[rollout_id]}, now {snapshot.snapshot_id}")
    return problems


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def task(transport: Any, run_id: str, index: int, calls: int, ack_early: bool) -> None:
    cycle = 0
    while True:
        rollout_id = f"{run_id}-t{index}-{cycle}"
        for call in range(calls):
            entry = make_entry(rollout_id, f"call-{call}", seed=cycle * 100 + call)
            if ack_early and index == 0 and cycle == 0 and call == 0:
                emit(f"PUT {rollout_id} call-{call} {entry_sha(entry)}")  # acknowledged, never put
                continue
            await transport.put(entry)
            emit(f"PUT {rollout_id} call-{call} {entry_sha(entry)}")
        snapshot = await transport.freeze(rollout_id)
        emit(f"FROZEN {rollout_id} {snapshot.snapshot_id} {snapshot.version}")
        if await transport.drop(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version):
            emit(f"DROPPED {rollout_id}")
        cycle += 1


async def main(url: str, run_id: str, tasks: int, calls: int, ack_early: bool) -> None:
    transport = TokenTransport.open(url)
    try:
        await asyncio.gather(*(task(transport, run_id, index, calls, ack_early) for index in range(tasks)))
    finally:
        await transport.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("run_id")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--ack-early", action="store_true")
    options = parser.parse_args()
    try:
        asyncio.run(main(options.url, options.run_id, options.tasks, options.calls, options.ack_early))
    except Exception:
        emit("ERROR " + traceback.format_exc().replace("\n", " | "))
        raise
