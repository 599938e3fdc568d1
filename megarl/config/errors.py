"""The configuration's error type, apart from the loader and the validation that both raise it."""


class ConfigError(ValueError):
    """A configuration key is unknown, mistyped or inconsistent; the message names the key."""
