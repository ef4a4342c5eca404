"""Moved: the connection plumbing is :mod:`reach_agent.connection`, ``run`` is
:mod:`reach_agent.runner`. Kept only for ``reach_broker.service`` until it imports
``reach_agent.connection`` (issue 10); delete then."""

from __future__ import annotations

from .connection import drain_or_close, flush_subscriptions

__all__ = ["drain_or_close", "flush_subscriptions"]
