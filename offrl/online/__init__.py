"""Online learning: the replay buffer, the one online loop that SAC and offline-to-online fine-tuning share, and the
fine-tuning strategies (naive, WSRL, RLPD, Cal-QL, JSRL, E2O) that configure it."""

from __future__ import annotations

from offrl.online.loop import episode_seed, make_envs, run_online
from offrl.online.replay import ReplayBuffer
from offrl.online.strategies import (E2O, JSRL, RLPD, STRATEGIES, WSRL, CalQLFineTuning, OnlineStrategy,
                                     resolve_strategy)

__all__ = ["ReplayBuffer", "OnlineStrategy", "WSRL", "RLPD", "CalQLFineTuning", "JSRL", "E2O", "STRATEGIES",
           "resolve_strategy", "run_online", "make_envs", "episode_seed"]
