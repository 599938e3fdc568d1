"""Typed run configuration: ``MegarlConfig`` (schema), ``read_config`` (YAML + overrides, typed), derived
defaults, the config's own consistency checks. Loading a run's config in full (with the names checked against
the algorithm registries) is :func:`megarl.run_config.load_config`."""

from megarl.config.errors import ConfigError
from megarl.config.loader import read_config, save_config, to_dict
from megarl.config.schema import MegarlConfig

__all__ = ["ConfigError", "MegarlConfig", "read_config", "save_config", "to_dict"]
