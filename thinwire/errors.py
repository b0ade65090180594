"""User-facing errors.

Every mistake a user can make (a bad config value, a missing data path, a corrupt checkpoint, a
codec spec that does not parse) is raised as a :class:`ThinwireError`. The CLI prints its message as
one paragraph and exits non-zero; it never shows a traceback for these. Internal invariants use
``assert`` and surface as ordinary tracebacks, because they are bugs.
"""

from __future__ import annotations


class ThinwireError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""


class ConfigError(ThinwireError, ValueError):
    """A config field has a value that is not allowed.

    The message always names the field, the value received and what is allowed, e.g.
    ``train.steps: must be an integer >= 1, got 0``.
    """

    def __init__(self, field: str, value: object, allowed: str, fix: str = "") -> None:
        self.field, self.value, self.allowed = field, value, allowed
        msg = f"{field}: must be {allowed}, got {value!r}"
        if fix:
            msg += f". {fix}"
        super().__init__(msg)
