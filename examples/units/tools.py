"""Two tools for the unit-conversion task (docs/byo-task.md): a class in verl's layout and a function.

`Convert` is loaded by tools.yaml (verl's tool config: class_name, config, tool_schema); the YAML's
schema names it `convert_units` and describes its arguments to the model. `unit_factor` is a plain
function: `--tool examples/units/tools.py:unit_factor` reads its schema from its type hints and
docstring. Both fail the way a model's calls fail: an unknown or misspelt unit, units of different
kinds, a value that is not a number. Each failure is text the model reads before it retries, and
SAAR cleans a failed call and its error out of the context once a retry succeeds, as it does for
Python.
"""

from __future__ import annotations

from cleaner.tools import Tool, ToolResult

# unit -> (kind, factor to the kind's base unit: metre, kilogram, second)
UNITS = {
    "mm": ("length", 0.001), "cm": ("length", 0.01), "m": ("length", 1.0), "km": ("length", 1000.0),
    "in": ("length", 0.0254), "ft": ("length", 0.3048), "mi": ("length", 1609.344),
    "g": ("mass", 0.001), "kg": ("mass", 1.0), "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125),
    "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0), "day": ("time", 86400.0),
}


def _unit(name: str) -> tuple[str, float]:
    if name not in UNITS:
        raise ValueError(f"unknown unit {name!r}; the units are {', '.join(UNITS)}")
    return UNITS[name]


class Convert(Tool):
    """convert_units(value, from_unit, to_unit): the value in the other unit."""

    name = "convert_units"
    description = "Convert a quantity from one unit to another."
    parameters = {
        "type": "object",
        "properties": {
            "value": {"type": "number", "description": "The quantity to convert."},
            "from_unit": {"type": "string", "description": "Its unit, e.g. km."},
            "to_unit": {"type": "string", "description": "The unit wanted, e.g. m."},
        },
        "required": ["value", "from_unit", "to_unit"],
    }

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema)
        self.digits = int(self.config.get("digits", 6))  # significant digits of the answer

    def call(self, arguments: dict) -> ToolResult | str:
        kind_from, factor_from = _unit(arguments["from_unit"])  # an unknown unit raises: a failed call
        kind_to, factor_to = _unit(arguments["to_unit"])
        if kind_from != kind_to:
            return ToolResult(f"cannot convert {kind_from} ({arguments['from_unit']}) to {kind_to} "
                              f"({arguments['to_unit']})", ok=False, error_type="DimensionError")
        value = float(arguments["value"]) * factor_from / factor_to
        return f"{value:.{self.digits}g} {arguments['to_unit']}"


def unit_factor(from_unit: str, to_unit: str) -> str:
    """How many `to_unit` make one `from_unit`.

    Args:
        from_unit: The unit to measure, e.g. mi.
        to_unit: The unit to measure it in, e.g. km.
    """
    kind_from, factor_from = _unit(from_unit)
    kind_to, factor_to = _unit(to_unit)
    if kind_from != kind_to:
        raise TypeError(f"{from_unit} is a {kind_from}, {to_unit} a {kind_to}")
    return f"1 {from_unit} = {factor_from / factor_to:.6g} {to_unit}"
