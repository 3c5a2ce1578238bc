"""models.yaml: loading and validation into typed, immutable configuration.

``schema.py`` holds the dataclasses (and every default), ``reader.py`` the generic reader that
collects problems, one module per section reads it (``gateway_settings.py``, ``defaults.py``,
``models.py``; ``residency.py`` and ``admission.py`` the settings of those two concerns across
sections) and ``loading.py`` puts the file together. Import from here.
"""

from gateway.config.gateway_settings import with_listen
from gateway.config.loading import load_config, parse_config
from gateway.config.reader import ConfigError
from gateway.config.schema import (
    ADMIN_KEY_ENV,
    ADMISSION_POLICIES,
    MAX_GPU_FRACTION_SUM,
    AdmissionSettings,
    Affinity,
    ApiKey,
    AuthSettings,
    Capabilities,
    EjectionSettings,
    FleetConfig,
    GatewaySettings,
    HealthSettings,
    MemoryBudget,
    ModelAdmission,
    ModelConfig,
    ModelDefaults,
    ModelLimits,
    QueueSettings,
    RetrySettings,
    SharedState,
    Timeouts,
)

__all__ = [
    "ADMIN_KEY_ENV",
    "ADMISSION_POLICIES",
    "MAX_GPU_FRACTION_SUM",
    "AdmissionSettings",
    "Affinity",
    "ApiKey",
    "AuthSettings",
    "Capabilities",
    "ConfigError",
    "EjectionSettings",
    "FleetConfig",
    "GatewaySettings",
    "HealthSettings",
    "MemoryBudget",
    "ModelAdmission",
    "ModelConfig",
    "ModelDefaults",
    "ModelLimits",
    "QueueSettings",
    "RetrySettings",
    "SharedState",
    "Timeouts",
    "load_config",
    "parse_config",
    "with_listen",
]
