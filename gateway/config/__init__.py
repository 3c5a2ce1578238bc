"""models.yaml: loading and validation into typed, immutable configuration.

``schema.py`` holds the dataclasses (and every default), ``reader.py`` the generic reader that
collects problems, one module per section reads it (``gateway_settings.py``, ``defaults.py``,
``models.py``) and ``loading.py`` puts the file together. Import from here.
"""

from gateway.config.gateway_settings import with_listen
from gateway.config.loading import load_config, parse_config
from gateway.config.reader import ConfigError
from gateway.config.schema import (
    ADMIN_KEY_ENV,
    MAX_GPU_FRACTION_SUM,
    Affinity,
    ApiKey,
    AuthSettings,
    Capabilities,
    EjectionSettings,
    FleetConfig,
    GatewaySettings,
    HealthSettings,
    HoldQueue,
    MemoryBudget,
    ModelConfig,
    ModelDefaults,
    ModelLimits,
    RetrySettings,
    SharedState,
    Timeouts,
)

__all__ = [
    "ADMIN_KEY_ENV",
    "MAX_GPU_FRACTION_SUM",
    "Affinity",
    "ApiKey",
    "AuthSettings",
    "Capabilities",
    "ConfigError",
    "EjectionSettings",
    "FleetConfig",
    "GatewaySettings",
    "HealthSettings",
    "HoldQueue",
    "MemoryBudget",
    "ModelConfig",
    "ModelDefaults",
    "ModelLimits",
    "RetrySettings",
    "SharedState",
    "Timeouts",
    "load_config",
    "parse_config",
    "with_listen",
]
