"""The event log's storage: tables, event bodies, opening a backend, WAL checkpoints."""
