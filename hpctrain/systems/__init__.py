"""The system registry: one TOML file per machine (``<name>.toml``), the device peaks
(``devices.toml``), and ``registry.py``, the one loader every command reads them with."""
