"""Run the store's random-sequence state machine (tests/test_state_machine.py) for longer.

    python tools/soak_state_machine.py [--examples 500] [--steps 50] [--seed N]

Prints how many sequences and steps of each operation ran; exits non-zero on the first
sequence that breaks an invariant (hypothesis prints the shrunk sequence).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import run_state_machine_as_test
from test_state_machine import StoreMachine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="random sequences to run (default 500)")
    parser.add_argument("--steps", type=int, default=50, help="steps per sequence at most (default 50)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default random)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # failed captures are part of the workload
    machine = StoreMachine
    if args.seed is not None:
        machine = seed(args.seed)(StoreMachine)
    started = time.monotonic()
    failed = False
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=args.examples,
                stateful_step_count=args.steps,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    except BaseException:
        failed = True
        raise
    finally:
        steps = dict(StoreMachine.steps)
        sequences = steps.pop("sequences", 0)
        print(f"sequences: {sequences}  steps: {sum(steps.values())}  in {time.monotonic() - started:.0f} s")
        for name, count in sorted(steps.items()):
            print(f"  {name}: {count}")
        print("FAILED: an invariant broke (see above)" if failed else "every invariant held after every step")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
