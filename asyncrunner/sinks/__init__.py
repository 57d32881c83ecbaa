"""Sinks: async resources that receive a run's events (``send``) and are closed at its end."""

from __future__ import annotations

from ._base import Sink
from ._callback import CallbackSink

__all__ = ["CallbackSink", "Sink"]
