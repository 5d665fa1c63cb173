"""Reading the log back: verified events, records by key, calls, and replay against projections."""
