"""The demo behind ``staging-store demo``: workers serve multi-turn rollouts from a toy engine,
a checkpoint cuts them mid-decoding, every worker is SIGKILLed, fresh workers continue each
cut call from its validated prefix, then the store is audited and exported.

``store.demo.engine`` is the deterministic toy engine, ``store.demo.worker`` the worker
process, ``store.demo.run`` the coordinator side (``run_demo``).
"""
