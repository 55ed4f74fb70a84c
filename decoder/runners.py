"""Runners: the one interface the decode loops call (`new_cache`, `forward(ids [q], cache, last_only)`),
for the stock Hugging Face path and the lean paths, and exact cache rollback for both cache kinds."""

from __future__ import annotations

import torch

from decoder.lean import LeanCache, LeanLM, StaticLeanLM


class HFRunner:
    """The stock path: a Hugging Face causal LM with a DynamicCache, behind the runner interface
    (`new_cache`, `forward(ids [q], cache, last_only) -> logits [q|1, V]`) that LeanLM shares."""

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def forward(self, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        return self.model(input_ids=ids.view(1, -1), past_key_values=cache, use_cache=True,
                          logits_to_keep=1 if last_only else 0).logits[0]


def as_runner(model):
    """A runner for `model`: runners pass through, a Hugging Face model gets wrapped."""
    return model if isinstance(model, (HFRunner, LeanLM, StaticLeanLM)) else HFRunner(model)


def crop_cache(cache, keep: int) -> None:
    """Roll a cache back to its first `keep` tokens (a length change for LeanCache; transformers 5
    crops a DynamicCache by a negative count)."""
    if isinstance(cache, LeanCache):
        cache.crop(keep)
        return
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)
