"""The job's environment for its records, as a job script keeps it:

    python -m hpctrain.jobs.env_record FILE

``FILE`` (the attempt's ``env.txt``) is created readable by its owner only, and the
values of names that look secret (``*TOKEN*``, ``*KEY*``, ``*SECRET*``, ``*PASSWORD*``,
...) are written as ``<set>``: run folders live on shared file systems, and an API token
in the environment (W&B, Hugging Face, a cloud key) must not be left world-readable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
HIDDEN = "<set>"


def looks_secret(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def environment_text(env: Mapping[str, str]) -> str:
    """One ``NAME=value`` line per variable, sorted; a secret's value hidden, and a
    value's line breaks written as ``\\n`` so that each variable keeps one line."""
    lines = []
    for name in sorted(env):
        value = HIDDEN if looks_secret(name) else env[name].replace("\n", "\\n")
        lines.append(f"{name}={value}\n")
    return "".join(lines)


def write_record(path: str, env: Mapping[str, str]) -> None:
    """A new file at ``path``, mode 0600 whatever the umask; an existing one is refused
    (each attempt has a folder of its own)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(environment_text(env))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m hpctrain.jobs.env_record FILE", file=sys.stderr)
        return 2
    try:
        write_record(argv[0], os.environ)
    except OSError as e:
        print(f"hpctrain job: warning: no environment record: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
