"""Forward-pass backends: one interface (``base.py``), one module per backend, and the registry that picks one."""
