"""Test helpers shared by suites (import as ``helpers.<module>`` from a test package)."""
