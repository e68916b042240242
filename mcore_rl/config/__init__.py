"""mcore-rl config: the structured schema, Hydra composition and validation."""

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.loader import load_config, validate
from mcore_rl.config.schema import TrainConfig

__all__ = ["ConfigError", "TrainConfig", "load_config", "validate"]
