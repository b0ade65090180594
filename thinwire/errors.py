"""User-facing errors.

Every mistake a user can make (a bad config value, a missing data path, a corrupt checkpoint, a
codec spec that does not parse) is raised as a :class:`ThinwireError`. The CLI prints its message as
one paragraph and exits non-zero; it never shows a traceback for these. Internal invariants use
``assert`` and surface as ordinary tracebacks, because they are bugs.

A message never repeats a user's value unbounded (a 375-byte YAML alias bomb once produced a 50 MB
message): values are shown through :func:`short`, and a whole message is cut at :data:`MAX_MESSAGE`.
"""

from __future__ import annotations

MAX_MESSAGE = 2000  # characters; a message longer than this is cut, ending in "..."
MAX_VALUE = 80      # characters of a value's repr shown in a message


def short(value: object, limit: int = MAX_VALUE) -> str:
    """``repr(value)`` cut to ``limit`` characters: ``'aaaa...' (1000000 characters)``."""
    try:
        text = repr(value)
    except Exception:  # a repr that fails (huge int, broken object) must not hide the real error
        text = f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


class ThinwireError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (_cut(args[0], MAX_MESSAGE),)
        super().__init__(*args)


class ConfigError(ThinwireError, ValueError):
    """A config field has a value that is not allowed.

    The message always names the field, the value received (cut by :func:`short`) and what is
    allowed, e.g. ``train.steps: must be an integer >= 1, got 0``.
    """

    def __init__(self, field: str, value: object, allowed: str, fix: str = "") -> None:
        self.field, self.value, self.allowed, self.fix = field, value, allowed, fix
        msg = f"{_cut(str(field), 200)}: must be {_cut(allowed, 1000)}, got {short(value)}"
        if fix:
            msg += f". {_cut(fix, 500)}"
        super().__init__(msg)

    def within(self, where: str) -> "ConfigError":
        """The same error with its field prefixed by ``where`` (``hosts`` -> ``plan.chosen.hosts``), unless it is
        already (a codec's own check names ``int8.block``, which read ``int8.int8.block``)."""
        field = self.field if not where or self.field.startswith(f"{where}.") else f"{where}.{self.field}"
        return ConfigError(field, self.value, self.allowed, self.fix)


class Missing:
    """The value of a required field that was not given; shown as ``nothing`` in a message."""

    def __repr__(self) -> str:
        return "nothing"


MISSING = Missing()


#: What gloo and NCCL say when the process at the other end of a connection has gone or stopped answering.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out waiting",
             "remote process exited", "NCCL communicator was aborted",
             "Application timeout caused pair closure")  # gloo: a peer cut off (a host killed) until timeout_s
#: A worker's exit code when it stopped because another worker had gone (``thinwire.train.worker``), and what it says.
LOST_PEER_EXIT = 3
LOST_PEER_SAYS = "stopped: lost another worker"


def cannot_write(path, error: OSError) -> ThinwireError:
    """A file that could not be written (a full disk, a read-only folder), as one paragraph."""
    why = error.strerror or str(error)
    return ThinwireError(f"cannot write {path}: {why}. Free space on that disk, or make the folder writable; files "
                         "already written there are unchanged.")


def lost_peer(error: BaseException) -> str | None:
    """What ``error`` (a collective's RuntimeError) says of a peer that has gone, without gloo's source
    location and advice (``Read error [10.0.0.2]:4471: Connection reset by peer``), or None."""
    if not isinstance(error, RuntimeError):  # gloo's and NCCL's (DistBackendError is one); not an OSError's "Broken pipe"
        return None
    text = str(error)
    for marker in PEER_GONE:
        at = text.find(marker)
        if at >= 0:
            start = text.rfind("] ", 0, at)  # gloo's "[.../pair.cc:537] " before the message
            start = start + 2 if start >= 0 else 0
            ends = [i for i in (text.find(". ", at), text.find("\n", at)) if i >= 0]
            return _cut(text[start:min(ends, default=len(text))].strip(), 300)
    return None
