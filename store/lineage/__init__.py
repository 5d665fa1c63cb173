"""Lineage views over the log: policy versions, the call tree of a rollout, linearize and export, policy workers.

This package reads the store's projections and events; nothing in the store's core imports
it (``Store``'s lineage methods delegate here).
"""

from store.lineage.export import ExportFailure, ExportReport
from store.lineage.tree import LineageCall, ResumedCut, RolloutLineage, RolloutSummary
from store.lineage.versions import RolloutVersions, StaleCall, StaleReport

__all__ = [
    "ExportFailure",
    "ExportReport",
    "LineageCall",
    "ResumedCut",
    "RolloutLineage",
    "RolloutSummary",
    "RolloutVersions",
    "StaleCall",
    "StaleReport",
]
