"""What a method's builder reads of the model it drafts for: the target and what is built once per model and shared
by every request (`drafting.Assets` holds them: heads, draft models, the cost table, low-bit copies, the suffix
cache). Builders see this protocol only, so proposers import nothing above them; what it returns of the proposers'
own kinds (the suffix cache, the layer-skip search, Medusa's accuracies, the drafter) is typed where it is used, so
this file imports no proposer (no import circle)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..models import Transformer
    from ..models.eagle import EagleHead
    from ..models.medusa import MedusaHeads
    from ..policy.cost import CostModel
    from .online_learning import OnlineHead

# what `draft=` names: a draft model (registry name, HF dir, .gguf file, or a loaded LLM) or trained heads' folder
Draft = str | os.PathLike | Any | None


class Assets(Protocol):
    model: Transformer

    def cost_model(self) -> CostModel: ...

    def suffix_cache(self, max_tokens: int | None = None) -> Any: ...  # suffix.SuffixCache

    def auto_branches(self) -> int: ...

    def draft_model(self, draft: Draft) -> Any: ...

    def skip_search(self) -> Any: ...  # layer_skip.SkipSearchResult

    def has_eagle_head(self) -> bool: ...

    def eagle_head(self, path: str | os.PathLike | None = None) -> EagleHead: ...

    def online_head(self, path: str | os.PathLike | None = None) -> OnlineHead: ...

    def medusa_heads(self, path: str | os.PathLike | None) -> MedusaHeads: ...

    def rank_accuracy(self, heads: MedusaHeads) -> Any: ...  # medusa.RankAccuracy

    def low_bit(self, kind: str) -> Transformer: ...

    def drafter(self, threads: int = 1) -> Any: ...  # async_draft.Drafter


def is_path(draft: Draft) -> bool:
    """A folder or file name (heads' folder, a draft's name), not a loaded model."""
    return draft is None or isinstance(draft, str | os.PathLike)
