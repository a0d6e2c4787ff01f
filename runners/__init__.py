"""Job runners: where a worker actually executes a job (inline, pooled, forked)."""

from __future__ import annotations
