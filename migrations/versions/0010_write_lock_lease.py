"""PostgreSQL: ``store_write_lock``, the write path's wait for the store's write lock, which ends
a holder whose lease is over.

A write transaction sends its statements as one pipeline, and a ship's batch streams its events
with ``COPY``: a host lost (or frozen) in the middle of either leaves its server session
``active``, waiting on its client, holding the write lock -- never "idle in transaction" (no
Sync came), and no statement timeout can end a session that waits for its client.  Its server
would keep the lock until TCP gave up (minutes), and every other writer would fail with
``LockTimeoutError``.  So the writers that wait end it: ``store_write_lock(lock_id, wait_ms,
lease_ms, check_ms)`` waits for the advisory lock ``lock_id`` at most ``wait_ms`` (then fails
as ``lock_timeout`` does, SQLSTATE 55P03), and every ``check_ms`` looks at the holder.  A holder
that is a store write (it holds the lease mark, ``store.log.postgres.LEASE_TAG``, whose id is
the time it was granted the lock), has held the lock ``lease_ms`` or longer, and waits on its
client (``wait_event_type = 'Client'``) at two looks in a row at the same statement, is ended
with ``pg_terminate_backend``: its transaction rolls back and the lock is free.  A holder that
is not a store write (a migration, a repair, anyone else) is never ended.  Ending another
session needs the same role, or ``pg_signal_backend``; without it the writer just waits, as
before.  SQLite has one writer per file and no sessions: nothing changes there.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

LEASE_TAG = 0x4C45  # store.log.postgres.LEASE_TAG (a migration does not import the library)

_FUNCTION = f"""
CREATE OR REPLACE FUNCTION store_write_lock(lock_id bigint, wait_ms integer, lease_ms integer, check_ms integer)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    deadline timestamptz := clock_timestamp() + wait_ms * interval '1 millisecond';
    slice_ms double precision;
    seen text;  -- the holder as the last look found it stuck: pid, grant, statement start
    holder record;
BEGIN
    LOOP
        slice_ms := least(check_ms, ceil(extract(epoch FROM deadline - clock_timestamp()) * 1000));
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', greatest(slice_ms, 1)::bigint::text, true);
            PERFORM pg_catalog.pg_advisory_xact_lock(lock_id);
            PERFORM pg_catalog.set_config('lock_timeout', wait_ms::text, true);
            RETURN true;
        EXCEPTION WHEN lock_not_available THEN
            IF clock_timestamp() >= deadline THEN
                RAISE;  -- the lock timeout's own error: the caller's LockTimeoutError
            END IF;
        END;
        PERFORM pg_catalog.pg_stat_clear_snapshot();  -- else pg_stat_activity stays as first read in this transaction
        SELECT a.pid, a.query_start,
               ((m.classid::bigint & 65535) << 32) | m.objid::bigint AS granted_ms
          INTO holder
          FROM pg_catalog.pg_locks l
          JOIN pg_catalog.pg_locks m
            ON m.pid = l.pid AND m.locktype = 'advisory' AND m.objsubid = 1 AND m.granted
           AND (m.classid::bigint >> 16) = {LEASE_TAG}
          JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ExclusiveLock'
           AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
           AND l.classid = (lock_id >> 32)::oid AND l.objid = (lock_id & 4294967295)::oid
           AND a.wait_event_type = 'Client'
         ORDER BY granted_ms
         LIMIT 1;
        IF holder.pid IS NULL
           OR holder.granted_ms > extract(epoch FROM clock_timestamp()) * 1000 - lease_ms THEN
            seen := NULL;  -- no holder stuck on its client past its lease
        ELSIF seen IS DISTINCT FROM concat_ws(' ', holder.pid, holder.granted_ms, holder.query_start) THEN
            seen := concat_ws(' ', holder.pid, holder.granted_ms, holder.query_start);  -- look once more
        ELSE
            BEGIN
                PERFORM pg_catalog.pg_terminate_backend(holder.pid, 1000);
                RAISE LOG 'staging-store: ended session % (write lock %: past its % ms lease, waiting on its client)',
                    holder.pid, lock_id, lease_ms;
            EXCEPTION WHEN insufficient_privilege THEN
                NULL;  -- another role's session: wait, as a plain lock wait would
            END;
            seen := NULL;
        END IF;
    END LOOP;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS store_write_lock(bigint, integer, integer, integer)")
