"""ROMIO hints (MPI-IO tuning keys) as text: ``"key=value,key=value"``, parsed by
``hpctrain.config.parse_hints`` so that the configuration checks them before MPI starts.

The keys that matter on Lustre (Eagle on Polaris, Flare on Aurora; see ``io/README.md``):
``striping_factor`` (stripe count) and ``striping_unit`` (stripe size in bytes) when
MPI-IO creates a file, ``cb_nodes`` (aggregator count) and ``romio_cb_read`` /
``romio_cb_write`` (two-phase collective buffering: ``enable``, ``disable``,
``automatic``), ``romio_ds_read`` (data sieving). ROMIO ignores keys it does not know.
"""

from __future__ import annotations

READ_DEFAULTS = {"romio_cb_read": "disable", "romio_ds_read": "disable"}
"""For windows at random offsets (``mpiio.py`` says why, docs/design/data-path.md has the
measurements); ``--data.romio_hints`` overrides them key by key."""
