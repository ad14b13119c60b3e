"""ROMIO hints (MPI-IO tuning keys) as text: ``"key=value,key=value"``. No MPI here, so
the configuration can check them before MPI starts.

The keys that matter on Lustre (Eagle on Polaris, Flare on Aurora; see ``io/README.md``):
``striping_factor`` (stripe count) and ``striping_unit`` (stripe size in bytes) when
MPI-IO creates a file, ``cb_nodes`` (aggregator count) and ``romio_cb_read`` /
``romio_cb_write`` (two-phase collective buffering: ``enable``, ``disable``,
``automatic``), ``romio_ds_read`` (data sieving). ROMIO ignores keys it does not know.
"""

from __future__ import annotations

import re

from hpctrain.errors import ConfigError

READ_DEFAULTS = {"romio_cb_read": "disable", "romio_ds_read": "disable"}
"""For windows at random offsets (``mpiio.py`` explains the measurements behind them);
``--data.romio_hints`` overrides them key by key."""
_KEY = re.compile(r"^[A-Za-z0-9_]+$")


def parse_hints(text: str) -> dict[str, str]:
    """``"striping_factor=8,romio_cb_read=enable"`` -> ``{"striping_factor": "8", ...}``."""
    hints = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _KEY.match(key) or not value:
            raise ConfigError(f"ROMIO hints look like key=value,key=value (e.g. "
                              f"romio_cb_read=enable,cb_nodes=8,striping_factor=8), not {text!r}")
        hints[key] = value
    return hints
