"""Configuration: one dataclass per section, TOML recipes, ``--section.key=value`` overrides.

Every field carries its help text (``opt(default, help)``), so ``hpctrain train RECIPE
--help`` can list them all. Each section checks itself in ``__post_init__``; checks that
need the number of ranks live in ``check_layout``. Every message names the fix.

The package in five files, imported from here:
  options.py    how a section declares an option (help, choices, range) and reads a value
  sections.py   the sections (``ModelConfig`` ... ``CommConfig``) and ``Config``
  checks.py     what a config cannot check on itself (ranks, the out_dir's file system)
  loading.py    recipe + overrides -> ``Config``; the option list for ``--help``
  recipe_file.py  ``Config`` -> a TOML recipe (``--print-config``, a run's config.toml)
"""

from hpctrain.config.checks import check_layout, check_out_dir
from hpctrain.config.loading import (DEPRECATED, RENAMED, build_config, config_from_dict,
                                     describe_options, load_config, parse_overrides,
                                     read_recipe, recipe_names)
from hpctrain.config.recipe_file import recipe_toml, write_run_config
from hpctrain.output_paths import RUN_CONFIG
from hpctrain.config.sections import (SECTION_TYPES, CommConfig, Config, DataConfig,
                                      ModelConfig, OptimConfig, ParallelConfig, TrainConfig,
                                      parse_hints)
from hpctrain.errors import ConfigError

__all__ = [
    "Config", "ModelConfig", "DataConfig", "ParallelConfig", "OptimConfig", "TrainConfig",
    "CommConfig", "SECTION_TYPES", "ConfigError", "parse_hints", "check_layout",
    "check_out_dir", "recipe_names", "read_recipe", "parse_overrides", "build_config",
    "load_config", "config_from_dict", "describe_options", "RENAMED", "DEPRECATED",
    "RUN_CONFIG", "recipe_toml", "write_run_config",
]
