"""Fake ``modules.api``."""
