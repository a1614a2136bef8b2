"""Exceptions raised by the io package."""


class InputError(Exception):
    """Input that fails the whole job: missing files, corrupt Parquet, unreadable paths."""


class OutputError(Exception):
    """The output folder cannot be written or read back."""
