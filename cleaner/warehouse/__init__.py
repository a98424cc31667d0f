"""Parquet warehouse: Arrow schemas, atomic part writer, validating reader, DuckDB views."""

from cleaner.warehouse.parts import WarehouseError
from cleaner.warehouse.store import Warehouse

__all__ = ["Warehouse", "WarehouseError"]
