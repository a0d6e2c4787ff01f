"""Integrations with web frameworks; each imports its framework, so import only the one
you use (``broker.contrib.django``)."""

from __future__ import annotations
