"""The one exception type for bad user input.

Raised at construction or set-up time, before any training work, with a message that names the
config key, the offending value and the fix, so a user never has to read a torch stack trace to
find a typo in their YAML.
"""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and the fix."""

    def __init__(self, key: str, value: object, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value!r}: {fix}")
