"""Small problems with exactly known values, for testing estimators and intervals.

- `TabularMDP`: a finite MDP with one-hot observations; logs episodes of
  any tabular policy as an offrl `Dataset` (with behaviour log-probs) and
  computes exact Q and V by dynamic programming.
- `SyntheticBandit`: a contextual bandit whose logs have OBP's layout
  (context, action, reward, pscore, position) and whose policy values are
  known in closed form.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from offrl.datasets.core import Dataset

__all__ = ["TabularMDP", "SyntheticBandit", "tabular_policy"]


def tabular_policy(pi: np.ndarray):
    """A target-policy callable from an (n_states, n_actions) table, for one-hot observations."""
    table = np.asarray(pi, np.float64)

    def probs(obs: np.ndarray) -> np.ndarray:
        return table[np.asarray(obs).argmax(1)]

    return probs


class TabularMDP:
    """A finite MDP: P[s, a, s'], mean rewards R[s, a], termination probabilities D[s, a], initial mu0[s].

    After action a in state s the episode terminates with probability D[s, a]
    (reward still paid); otherwise it moves to s' ~ P[s, a].  Rewards are
    R[s, a] plus N(0, reward_noise^2).
    """

    def __init__(self, P: Any, R: Any, D: Any = None, mu0: Any = None, reward_noise: float = 0.0) -> None:
        self.P = np.asarray(P, np.float64)
        self.R = np.asarray(R, np.float64)
        self.n_states, self.n_actions = self.R.shape
        self.D = np.zeros_like(self.R) if D is None else np.asarray(D, np.float64)
        self.mu0 = np.full(self.n_states, 1.0 / self.n_states) if mu0 is None else np.asarray(mu0, np.float64)
        self.reward_noise = float(reward_noise)

    @classmethod
    def random(cls, n_states: int = 4, n_actions: int = 2, terminal_prob: float = 0.0, reward_noise: float = 0.0,
               deterministic: bool = False, seed: int = 0) -> "TabularMDP":
        rng = np.random.default_rng(seed)
        if deterministic:
            P = np.zeros((n_states, n_actions, n_states))
            nxt = rng.integers(n_states, size=(n_states, n_actions))
            P[np.arange(n_states)[:, None], np.arange(n_actions)[None, :], nxt] = 1.0
            mu0 = np.eye(n_states)[0]
        else:
            P = rng.dirichlet(np.ones(n_states), size=(n_states, n_actions))
            mu0 = None
        R = rng.uniform(0.0, 1.0, size=(n_states, n_actions))
        D = np.full((n_states, n_actions), float(terminal_prob))
        return cls(P, R, D, mu0, reward_noise)

    @classmethod
    def from_dataset(cls, dataset: Dataset) -> "TabularMDP":
        """The certainty-equivalent MDP of a one-hot dataset (maximum-likelihood P, R, D; unvisited pairs absorb)."""
        S, A = dataset.observation_dim, int(dataset.discrete_actions)
        s = dataset.observations.argmax(1)
        a = dataset.actions[:, 0].astype(np.int64)
        s2 = dataset.next_observations.argmax(1)
        count = np.zeros((S, A))
        np.add.at(count, (s, a), 1.0)
        safe = np.maximum(count, 1.0)
        R = np.zeros((S, A))
        np.add.at(R, (s, a), dataset.rewards)
        D = np.zeros((S, A))
        np.add.at(D, (s, a), dataset.terminals)
        P = np.zeros((S, A, S))
        live = dataset.terminals == 0
        np.add.at(P, (s[live], a[live], s2[live]), 1.0)
        P_sum = P.sum(-1, keepdims=True)
        P = np.where(P_sum > 0, P / np.maximum(P_sum, 1.0), 1.0 / S)
        D = np.where(count > 0, D / safe, 1.0)
        mu0 = np.bincount(s[dataset.episode_starts[:-1]], minlength=S) / dataset.n_episodes
        return cls(P, R / safe, D, mu0)

    # ------------------------------------------------------------------ exact values
    def q_values(self, pi: Any, gamma: float, horizon: int | None = None) -> np.ndarray:
        """Exact Q^pi: (n_states, n_actions) for horizon None (stationary), else (horizon + 1, S, A) indexed by steps to go."""
        pi = np.asarray(pi, np.float64)
        cont = gamma * (1.0 - self.D)[:, :, None] * self.P  # (S, A, S')
        if horizon is None:
            # Q = R + cont @ (pi * Q).sum(-1)  -> linear system in Q (S*A unknowns)
            S, A = self.R.shape
            M = np.einsum("sat,tb->satb", cont, pi).reshape(S * A, S * A)
            q = np.linalg.solve(np.eye(S * A) - M, self.R.reshape(-1))
            return q.reshape(S, A)
        out = np.zeros((horizon + 1, *self.R.shape))
        for h in range(1, horizon + 1):
            v_next = (pi * out[h - 1]).sum(-1)
            out[h] = self.R + cont @ v_next
        return out

    def value(self, pi: Any, gamma: float, horizon: int | None = None) -> float:
        """Exact expected discounted return from mu0 (over `horizon` steps, or until termination)."""
        q = self.q_values(pi, gamma, horizon)
        q0 = q if horizon is None else q[horizon]
        return float(self.mu0 @ (np.asarray(pi) * q0).sum(-1))

    # ------------------------------------------------------------------ logging
    def sample(self, pi: Any, n_episodes: int, horizon: int | None = None, seed: Any = 0,
               max_steps: int = 10_000) -> Dataset:
        """Log `n_episodes` of policy `pi` as a Dataset (one-hot observations, discrete actions, behaviour log-probs).

        Episodes end at a termination or after `horizon` steps (a time-limit cut).
        """
        rng = np.random.default_rng(seed)
        pi = np.asarray(pi, np.float64)
        S, A = self.R.shape
        limit = max_steps if horizon is None else int(horizon)
        states = rng.choice(S, size=n_episodes, p=self.mu0)
        alive = np.ones(n_episodes, bool)
        cols: dict[str, list] = {k: [] for k in ("ep", "t", "s", "a", "r", "term", "trunc", "s2", "lp")}
        for t in range(limit):
            idx = np.flatnonzero(alive)
            if len(idx) == 0:
                break
            s = states[idx]
            u = rng.random(len(idx))
            a = np.minimum((u[:, None] > np.cumsum(pi[s], 1)).sum(1), A - 1)
            r = self.R[s, a] + self.reward_noise * rng.standard_normal(len(idx))
            term = rng.random(len(idx)) < self.D[s, a]
            cdf = np.cumsum(self.P[s, a], 1)
            s2 = np.minimum((rng.random(len(idx))[:, None] > cdf).sum(1), S - 1)
            trunc = ~term & (t == limit - 1)
            for key, val in (("ep", idx), ("t", np.full(len(idx), t)), ("s", s), ("a", a), ("r", r),
                             ("term", term), ("trunc", trunc), ("s2", s2), ("lp", np.log(pi[s, a]))):
                cols[key].append(val)
            states[idx] = s2
            alive[idx[term | trunc]] = False
        c = {k: np.concatenate(v) for k, v in cols.items()}
        order = np.lexsort((c["t"], c["ep"]))
        c = {k: v[order] for k, v in c.items()}
        ends = (c["term"] | c["trunc"])
        eye = np.eye(S, dtype=np.float32)
        change = np.flatnonzero(np.diff(c["ep"])) + 1
        starts = np.concatenate([[0], change, [len(c["ep"])]])
        return Dataset(
            observations=eye[c["s"]], actions=c["a"][:, None].astype(np.float32), rewards=c["r"],
            terminals=c["term"].astype(np.float32), timeouts=(ends & ~c["term"]).astype(np.float32),
            next_observations=eye[c["s2"]], episode_starts=starts, behavior_log_probs=c["lp"],
            discrete_actions=A, metadata={"name": "tabular-mdp"},
        )


class SyntheticBandit:
    """Contextual bandit with linear-logistic expected rewards and a softmax behaviour policy.

    q(x, a) = sigmoid(x . theta_a); rewards are Bernoulli(q) (or q plus
    Gaussian noise with `reward_type="continuous"`).  Logs follow OBP's
    bandit-feedback layout.
    """

    def __init__(self, n_actions: int = 5, dim_context: int = 3, beta: float = 1.0, reward_type: str = "binary",
                 len_list: int = 1, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.n_actions, self.dim_context, self.beta = n_actions, dim_context, beta
        self.reward_type, self.len_list = reward_type, len_list
        self.theta = rng.normal(size=(dim_context, n_actions))
        self.behavior_theta = rng.normal(size=(dim_context, n_actions))
        self.position_effect = np.linspace(1.0, 0.6, len_list)

    def expected_reward(self, context: np.ndarray) -> np.ndarray:
        """(n, n_actions, len_list) expected rewards."""
        base = 1.0 / (1.0 + np.exp(-(context @ self.theta)))
        return base[:, :, None] * self.position_effect[None, None, :]

    def behavior_probs(self, context: np.ndarray) -> np.ndarray:
        logits = self.beta * (context @ self.behavior_theta)
        logits -= logits.max(1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(1, keepdims=True)

    def obtain_batch_bandit_feedback(self, n_rounds: int, seed: Any = 0) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        context = rng.normal(size=(n_rounds, self.dim_context))
        p = self.behavior_probs(context)
        action = np.minimum((rng.random((n_rounds, 1)) > np.cumsum(p, 1)).sum(1), self.n_actions - 1)
        position = rng.integers(self.len_list, size=n_rounds) if self.len_list > 1 else None
        q = self.expected_reward(context)
        pos = np.zeros(n_rounds, int) if position is None else position
        mean = q[np.arange(n_rounds), action, pos]
        if self.reward_type == "binary":
            reward = (rng.random(n_rounds) < mean).astype(np.float64)
        else:
            reward = mean + 0.1 * rng.standard_normal(n_rounds)
        return {
            "n_rounds": n_rounds, "n_actions": self.n_actions, "context": context, "action": action,
            "reward": reward, "pscore": p[np.arange(n_rounds), action], "position": position,
            "expected_reward": q, "pi_b": p[:, :, None],
        }

    @staticmethod
    def calc_ground_truth_policy_value(expected_reward: np.ndarray, action_dist: np.ndarray,
                                       position: np.ndarray | None = None) -> float:
        """E_x[sum_a pi(a|x) q(x, a)] on the given contexts (at each round's position)."""
        n = len(expected_reward)
        pos = np.zeros(n, int) if position is None else np.asarray(position)
        return float((expected_reward[np.arange(n), :, pos] * action_dist[np.arange(n), :, pos]).sum(1).mean())
