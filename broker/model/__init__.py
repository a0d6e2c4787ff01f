"""The foundation's private helpers: value shapes, setting checks, limits, logging and redaction.

Everything here sits under the job model and the storage contract, so any package may import
it; it imports nothing of the broker but :mod:`broker.exceptions`.
"""
