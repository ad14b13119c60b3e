"""Errors a user can cause and fix.

A ``UserError`` is printed as one message (no traceback) that names the fix, and the
process exits with ``EXIT_USER_ERROR``. Anything else is a bug and gets a traceback.
"""

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input: config, files, world size, checkpoints. The message names the fix."""


class ConfigError(UserError):
    """A recipe or a ``--section.key=value`` override is invalid."""


class DataError(UserError):
    """A dataset file is missing, corrupt, or does not fit the model."""


class JobError(UserError):
    """A job script or launch request is invalid: system, queue limits, directives."""


class NonFiniteError(UserError):
    """A step's loss or gradient norm is NaN or inf (``--train.on_nonfinite=abort``)."""


class CommTimeout(RuntimeError):
    """An MPI wait passed its deadline: some rank is stuck or dead."""
