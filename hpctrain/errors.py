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


def factor_hint(size: int, n: int, option: str = "--parallel.pp", group: int = 1) -> str:
    """How to make ``size`` units (ranks, or tensor-parallel groups of ``group`` ranks)
    and ``option``'s value ``n`` fit together. Here because two layers name this fix:
    the config's layout check and the process grid (``comm/``, below the config)."""
    options = [d for d in range(1, size + 1) if size % d == 0]
    units = "ranks" if group == 1 else f"tensor-parallel groups ({group} ranks each)"
    more = n * (size // n + 1) * group
    return (f"{option} must divide the number of {units}: one of "
            f"{', '.join(map(str, options))}; or run on a multiple of {n * group} ranks "
            f"(mpiexec -n {more})")
