"""Audits over the whole log: the store-wide audit (and, later, rebuild and export).

Imports go one way: this package reads the store's modules; nothing in ``store`` imports it
but ``Store.audit``, which delegates here.
"""

from store.audit.report import AuditProblem, AuditReport
from store.audit.store_audit import audit_store

__all__ = ["AuditProblem", "AuditReport", "audit_store"]
