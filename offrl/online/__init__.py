"""Online learning pieces: the replay buffer (and, later, offline-to-online fine-tuning)."""

from __future__ import annotations

from offrl.online.replay import ReplayBuffer

__all__ = ["ReplayBuffer"]
