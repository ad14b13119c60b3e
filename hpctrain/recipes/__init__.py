"""Built-in training recipes (TOML), shipped as package data."""
