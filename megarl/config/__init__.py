"""Typed run configuration: ``MegarlConfig`` (schema), ``load_config`` (YAML + overrides), validation."""

from megarl.config.errors import ConfigError
from megarl.config.loader import load_config, save_config, to_dict
from megarl.config.schema import MegarlConfig
from megarl.config.validate import validate_config

__all__ = ["ConfigError", "MegarlConfig", "load_config", "save_config", "to_dict", "validate_config"]
