"""Every option, declared once: the frozen config dataclasses (settings.py), the commands' flags
generated from their fields (flags.py) and a run's config from layers (layers.py: defaults < saved
run < TOML file < flags).

The dataclasses are re-exported here, so callers write `from cleaner.config import CollectConfig`.
"""

from cleaner.config.settings import (
    ASSETS_DIR,
    DEFAULT_POLICY,
    ENV_POLICY,
    RECOVER_POLICY,
    UNSHARDED,
    CollectConfig,
    DpoCap,
    Edit,
    EvalConfig,
    IsMode,
    PromptStyle,
    PurifyConfig,
    PurifyWhen,
    RunConfig,
    SandboxConfig,
    Shard,
    SimilarityOn,
    TrainConfig,
)

__all__ = ["ASSETS_DIR", "DEFAULT_POLICY", "ENV_POLICY", "RECOVER_POLICY", "UNSHARDED", "CollectConfig", "DpoCap",
           "Edit", "EvalConfig", "IsMode", "PromptStyle", "PurifyConfig", "PurifyWhen", "RunConfig", "SandboxConfig",
           "Shard", "SimilarityOn", "TrainConfig"]
