"""Online learning: the replay buffer and the one online loop that SAC and offline-to-online fine-tuning share."""

from __future__ import annotations

from offrl.online.loop import OnlineStrategy, episode_seed, make_envs, run_online
from offrl.online.replay import ReplayBuffer

__all__ = ["ReplayBuffer", "OnlineStrategy", "run_online", "make_envs", "episode_seed"]
