"""Several models in one server, loaded by use within a byte budget (registry.py)."""
