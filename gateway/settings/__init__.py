"""The configuration: the frozen model, loading it from YAML, and parsing its values.

`model` is what the rest of the gateway receives, and the one place each key is written;
`fields` is how a model field carries its parser and description; `load` turns a file (or the
embedded default) into the model, reporting every problem with its key path; `parse` holds the
value parsers; `schema` prints the JSON Schema.
"""

from gateway.settings.load import (
    ConfigError,
    check_config,
    default_settings,
    describe_pools,
    load_settings,
    parse_settings,
)
from gateway.settings.model import (
    RELOADED_SERVER_KEYS,
    AffinitySettings,
    BackendSettings,
    BudgetSettings,
    DelaySettings,
    HealthSettings,
    HedgingSettings,
    MiB,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
    StallSettings,
    Timeouts,
    TracingSettings,
)

__all__ = [
    "RELOADED_SERVER_KEYS",
    "AffinitySettings",
    "BackendSettings",
    "BudgetSettings",
    "ConfigError",
    "DelaySettings",
    "HealthSettings",
    "HedgingSettings",
    "MiB",
    "PoolSettings",
    "ServerSettings",
    "Settings",
    "SimProfile",
    "StallSettings",
    "Timeouts",
    "TracingSettings",
    "check_config",
    "default_settings",
    "describe_pools",
    "load_settings",
    "parse_settings",
]
