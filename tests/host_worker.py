"""An inference worker on a simulated host, for ``test_host_loss.py`` and ``tools/soak_host_loss.py``
(not a test module).  Run inside a network namespace with ``ip netns exec``.

    python tests/host_worker.py serve STORE REPLICA_URL ROLLOUT NCALLS REPLICA_WAIT
        Opens its local store (on the host's tmpfs) in the replicated domain, stages the root of
        ROLLOUT and admits NCALLS live child calls, then reads commands, one a line:
          decode N      every live call decodes up to generated position N    -> ``OK``
          cut NAME      serves a cut naming every live call -> ``RECEIPT <json> <domain>``; a cut
                        refused because its receipt did not reach the replica in time gives what
                        Gym makes of a refused cut, every call ``durable_failure``, with domain
                        ``refused``
          replicate S   waits S seconds at most for the replica   -> ``REPLICATED True|False``
          exit          closes the store                           -> ``BYE``
    python tests/host_worker.py continue REPLICA_URL ROLLOUT CALL...
        A replacement worker: opens the replica alone, continues each CALL from its newest cut,
        decodes the rest and prints ``FINAL <call> <json>`` each, then ``DONE``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import replica_helpers as rh

from store import (
    GenerationCutError,
    GenerationCutInventory,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
    open_store,
    to_json,
)


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def serve(path: str, replica: str, rollout: str, ncalls: int, wait: float) -> int:
    store = open_store(path, replica=replica, domain="replicated", replica_wait=wait)
    capture = rh.capture_on(store)
    root = rh.stage_root(capture, rollout)
    calls = range(1, ncalls + 1)
    live = {call: rh.admit(capture, root, call) for call in calls}
    decoded = 0
    emit("READY")
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "decode":
            upto = int(argument)
            for call, active in live.items():
                rh.decode(capture, active, call, decoded, upto)
            decoded = max(decoded, upto)
            emit("OK")
        elif command == "cut":
            inventory = rh.inventory(argument, calls, rollout)
            try:
                receipt = capture.serve_generation_cut(inventory)
            except GenerationCutError as exc:
                if exc.code != "replica_unavailable":
                    raise
                emit(f"RECEIPT {to_json(refused(inventory)).decode()} refused")
                continue
            domain = store.cut_domain(receipt.checkpoint_id, receipt.inventory_digest)
            emit(f"RECEIPT {to_json(receipt).decode()} {domain}")
        elif command == "replicate":
            emit(f"REPLICATED {store.replicate(wait=float(argument))}")
        elif command == "exit":
            capture.close()
            store.close()
            emit("BYE")
            return 0
        else:
            emit(f"UNKNOWN {command}")
    return 0


def refused(inventory: GenerationCutInventory) -> GenerationCutReceipt:
    """What Gym makes of a refused cut: every call of the inventory ``durable_failure``."""
    acks = [
        GenerationCutPrefixAck(
            ticket_id=prefix.ticket_id,
            rollout_id=prefix.rollout_id,
            attempt_index=prefix.attempt_index,
            model_call_id=prefix.model_call_id,
            admitted_at=prefix.admitted_at,
            disposition="durable_failure",
        )
        for prefix in inventory.active_prefixes
    ]
    return GenerationCutReceipt(
        checkpoint_id=inventory.checkpoint_id,
        cut_id=f"worker-{inventory.inventory_digest}",
        inventory_digest=inventory.inventory_digest,
        inventory=inventory,
        backend_snapshot_id=f"tq-{inventory.inventory_digest}",
        prefixes=tuple(acks),
    )


def continue_calls(replica: str, rollout: str, calls: list[int]) -> int:
    with open_store(replica) as store:
        for call in calls:
            emit(f"FINAL {call} {rh.final_json(rh.continue_from(store, call, rollout))}")
    emit("DONE")
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "serve":
        return serve(argv[1], argv[2], argv[3], int(argv[4]), float(argv[5]))
    if argv[0] == "continue":
        return continue_calls(argv[1], argv[2], [int(call) for call in argv[3:]])
    raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
