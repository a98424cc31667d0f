"""Parquet warehouse: Arrow schemas, atomic part writer with page checksums, verifying reader, DuckDB
views, the verification manifest and compaction (docs/architecture.md §3)."""

from cleaner.warehouse.parts import WarehouseError
from cleaner.warehouse.store import Warehouse

__all__ = ["Warehouse", "WarehouseError"]
