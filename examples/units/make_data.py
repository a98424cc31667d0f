"""Write the unit-conversion task as a verl RL Parquet file (docs/byo-task.md).

    python examples/units/make_data.py units.parquet [--rows 64] [--seed 0]

Each row asks for a quantity in another unit; `reward_model.ground_truth` is the converted value,
`extra_info` holds the row's index (the prompt id) and the tolerance the reward file allows.
"""

from __future__ import annotations

import argparse
import random

import pyarrow as pa
import pyarrow.parquet as pq

PAIRS = [("km", "m", 1000.0), ("mi", "km", 1.609344), ("ft", "in", 12.0), ("lb", "kg", 0.45359237),
         ("h", "s", 3600.0), ("oz", "g", 28.349523125), ("day", "min", 1440.0), ("cm", "mm", 10.0)]


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        unit_from, unit_to, factor = rng.choice(PAIRS)
        value = round(rng.uniform(0.5, 500.0), rng.choice([0, 1, 2]))
        question = (f"Convert {value:g} {unit_from} to {unit_to}. Call the convert_units tool, then give the "
                    f"number alone as \\boxed{{...}}.")
        out.append({
            "data_source": "units",
            "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": repr(value * factor)},
            "extra_info": {"index": index, "rel_tol": 1e-4},
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the Parquet file to write")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pq.write_table(pa.Table.from_pylist(rows(args.rows, args.seed)), args.out)
    print(f"wrote {args.rows} rows to {args.out}")


if __name__ == "__main__":
    main()
