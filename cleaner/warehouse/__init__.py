"""Parquet warehouse: Arrow schemas, atomic part writer, validating reader, DuckDB views, the
validation manifest and compaction (docs/architecture.md §3)."""

from cleaner.warehouse.parts import WarehouseError
from cleaner.warehouse.store import Warehouse

__all__ = ["Warehouse", "WarehouseError"]
