"""Every option of the phase commands and `cleaner run`, declared once (docs/architecture.md §9).

- groups.py: how a field is declared and checked; SAAR's settings group.
- settings.py: the frozen config dataclasses (curate's too), holding the groups they use; the rollouts' group.
  A field is an option: its type, its default, its check (its class's) and its help, which is the flag's.
- flags.py: which flags each command takes (one per field), and what a command does otherwise.
- layers.py: a config from layers of dicts (for `run`: defaults < saved run < TOML file < flags).

cli/options.py turns the flags into typer options. An option takes effect where its stage reads
`config.<field>` (under cleaner/engine/, cleaner/loop/ for a run). The dataclasses are re-exported
here: `from cleaner.config import CollectConfig`.
"""

from cleaner.config.groups import (
    Edit,
    IsMode,
    PurifyWhen,
    SaarMerge,
    SaarRollback,
    SaarSettings,
    SaarView,
    SimilarityOn,
)
from cleaner.config.settings import (
    ASSETS_DIR,
    DEFAULT_POLICY,
    ENV_POLICY,
    GSPO_AGG_MODE,
    LOSS_AGG_MODES,
    RECOVER_POLICY,
    UNSHARDED,
    AdvEstimator,
    CollectConfig,
    CurateConfig,
    DownSample,
    DpoCap,
    EvalConfig,
    LossMode,
    PromptStyle,
    PurifyConfig,
    RolloutSettings,
    RunConfig,
    Schedule,
    Shard,
    TrainConfig,
)
from cleaner.sandbox.config import SandboxConfig

__all__ = ["ASSETS_DIR", "DEFAULT_POLICY", "ENV_POLICY", "GSPO_AGG_MODE", "LOSS_AGG_MODES", "RECOVER_POLICY", "UNSHARDED",
           "AdvEstimator", "CollectConfig", "CurateConfig", "DownSample", "DpoCap",
           "Edit", "EvalConfig", "IsMode", "LossMode", "PromptStyle", "PurifyConfig", "PurifyWhen", "RolloutSettings",
           "RunConfig", "SaarMerge", "SaarRollback", "SaarSettings", "SaarView", "SandboxConfig", "Schedule", "Shard",
           "SimilarityOn", "TrainConfig"]
