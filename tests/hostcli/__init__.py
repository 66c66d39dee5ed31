"""Host CLI and initiator YAML units (no target, no FUSE)."""
