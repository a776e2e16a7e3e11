"""What a request gives back, and how the command line prints it: its statistics (`stats`), its stream's events and
final result (`events`), and plain-text tables (`tables`: a request's statistics, a benchmark's or a memory plan's
rows)."""

from .events import Result, StreamEvent
from .stats import Stats

__all__ = ["Result", "Stats", "StreamEvent"]
