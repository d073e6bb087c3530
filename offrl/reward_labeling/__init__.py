"""Labelling logs that lack rewards or actions: scikit-learn transformers of Datasets.

- `OTRewardLabeler`: rewards from an optimal-transport alignment to expert demonstrations (OTR);
- `InverseDynamicsLabeler`: missing actions from an inverse-dynamics model p(a | s, s') (SS-ORL);
- `RewardModelLabeler`: missing rewards from a reward model fitted on the labelled rows.

Each fits and transforms Datasets, records what it labelled in
`metadata["transforms"]`, composes with any algorithm in a `Pipeline`, and
saves its fitted state with it.
"""

from offrl.reward_labeling.learned import InverseDynamicsLabeler, RewardModelLabeler
from offrl.reward_labeling.optimal_transport import OTRewardLabeler, pairwise_cost, sinkhorn, transport_plan

__all__ = ["OTRewardLabeler", "InverseDynamicsLabeler", "RewardModelLabeler", "sinkhorn", "pairwise_cost",
           "transport_plan"]
