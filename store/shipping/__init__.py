"""Log shipping: copy one store's events into another (``Store.ship``), keeping their identity."""

from store.shipping.identity import EventOrigin
from store.shipping.report import ShipProblem, ShipReport

__all__ = ["EventOrigin", "ShipProblem", "ShipReport"]
