"""Projections: pure folds of log events into the tables that queries read."""
