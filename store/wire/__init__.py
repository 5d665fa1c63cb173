"""The wire: Gym-compatible records, their digests and packed token columns (pure, no storage)."""
