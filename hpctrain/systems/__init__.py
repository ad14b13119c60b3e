"""The system registry: one TOML file per machine (``<name>.toml``), read by one loader
(``registry.py``), and the device peaks (``devices.toml``, read by ``devices.py``)."""
