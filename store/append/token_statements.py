"""The statements of the complete-record transport's projections (``token_rollouts``,
``token_entries``), compiled once per dialect with the write path's others."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from store.log import schema
from store.log.engine import Statement
from store.projections.tokens import TOKEN_ENTRY_COLUMNS, TOKEN_ROLLOUT_COLUMNS


class TokenStatements:
    """Reads and writes of the transport's projection rows inside the write transaction."""

    def __init__(self, engine: Engine) -> None:
        rollouts, entries = schema.token_rollouts, schema.token_entries
        rollouts_fenced = schema.rollouts
        rollout_id: sa.BindParameter[str] = sa.bindparam("rollout_id")
        # One read for a transport write: the rollout's row, the capture key's fence and (for a
        # put) the payload digest of the call's entry, if any (one row always: left joins).
        one = sa.select(sa.literal_column("1").label("one")).subquery("one")
        joined = (
            one.outerjoin(rollouts, rollouts.c.rollout_id == rollout_id)
            .outerjoin(rollouts_fenced, rollouts_fenced.c.rollout_id == rollout_id)
            .outerjoin(
                entries,
                sa.and_(entries.c.rollout_id == rollout_id, entries.c.model_call_id == sa.bindparam("model_call_id")),
            )
        )
        picked = [
            *(rollouts.c[name] for name in TOKEN_ROLLOUT_COLUMNS),
            rollouts_fenced.c.fenced,
            rollouts_fenced.c.fence_seq,
            entries.c.payload_digest,
        ]
        self.lookup = Statement(sa.select(*picked).select_from(joined), engine)
        self.insert_rollout = Statement(
            sa.insert(rollouts).values({name: sa.bindparam(name) for name in TOKEN_ROLLOUT_COLUMNS}), engine
        )
        self.update_rollout = Statement(
            sa.update(rollouts)
            .where(rollouts.c.rollout_id == sa.bindparam("b_rollout_id"))
            .values({name: sa.bindparam(name) for name in TOKEN_ROLLOUT_COLUMNS if name != "rollout_id"}),
            engine,
        )
        self.select_rollout = Statement(
            sa.select(*(rollouts.c[name] for name in TOKEN_ROLLOUT_COLUMNS)).where(rollouts.c.rollout_id == rollout_id),
            engine,
        )
        self.insert_entry = Statement(
            sa.insert(entries).values({name: sa.bindparam(name) for name in TOKEN_ENTRY_COLUMNS}), engine
        )
