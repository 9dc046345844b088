"""Fake ``modules.paths``: the fixture sets ``models_path`` to a temporary folder."""

models_path = "models"
script_path = "."
