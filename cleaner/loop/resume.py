"""The config a run starts or resumes with (docs/architecture.md §9).

On resume, the saved run's config is the layer beneath the ones given, and nothing but
`iterations` and the fields that never count toward an id (how rollouts are scheduled, where a
server is) may differ from it: a resumed run computes what it started to. No torch here:
`cleaner run --print-config` resolves a config without loading the model stack.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from cleaner.config import RunConfig
from cleaner.config.layers import RUN_BASE_LAYER, ConfigError, differences, resolve_run_config
from cleaner.config.settings import SCORED_AS_COLLECTED
from cleaner.warehouse import Warehouse


def resolved_run(layers: list[dict], where: str, resume: bool,
                 names: Mapping[tuple[str, ...], str] | None = None) -> RunConfig:
    """The RunConfig of the layers (`where`: what they came from; `names`: the flag of each field a
    flag set), on resume over the saved run's; ConfigError naming what is wrong or what differs."""
    config = resolve_run_config(RUN_BASE_LAYER, *layers, where=where, names=names)
    saved = Warehouse(Path(config.run_dir) / "warehouse").load_config("run") if resume else None
    if saved is None:
        return config
    saved_layer = json.loads(saved)
    for name in SCORED_AS_COLLECTED:  # collect's by construction: the layers above decide them
        saved_layer.get("purify", {}).pop(name, None)
    config = resolve_run_config(RUN_BASE_LAYER, saved_layer, *layers, where=where, names=names)
    # the saved run resolved alone: a field added since it was saved takes its default there
    saved_config = resolve_run_config(RUN_BASE_LAYER, saved_layer, where=where, names=names)
    free = ("iterations", *(f"{table}.{item.name}" for table in ("collect", "purify", "train")  # not what is computed
                            for item in dataclasses.fields(getattr(config, table)) if item.metadata["identity"] == "never"))
    changed = differences(json.loads(saved_config.to_json()), json.loads(config.to_json()), ignore=free)
    if changed:
        raise ConfigError(f"{config.run_dir} was started with another config; --resume continues it as it "
                          f"was (only --iterations and how rollouts are scheduled may change). Differs: "
                          f"{'; '.join(changed)}")
    return config
