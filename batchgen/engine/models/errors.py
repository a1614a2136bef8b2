"""The error a model raises when its architecture or settings are not ones the engine implements."""


class UnsupportedModelError(ValueError):
    """The model's architecture or settings are not ones the engine implements."""
