from .async_draft import AsyncDraftProposer, Drafter
from .base import NoProposer, Proposer
from .draft_model import DraftModelProposer
from .eagle import EagleProposer
from .hybrid import HybridProposer
from .layer_skip import LayerSkipProposer
from .lookahead import LookaheadProposer
from .medusa import MedusaProposer
from .prompt_lookup import PromptLookupProposer
from .quantized import QuantizedSelfProposer
from .suffix import SuffixCache, SuffixProposer

__all__ = ["AsyncDraftProposer", "Drafter", "Proposer", "NoProposer", "PromptLookupProposer", "DraftModelProposer",
           "HybridProposer",
           "LookaheadProposer", "LayerSkipProposer", "EagleProposer", "MedusaProposer", "QuantizedSelfProposer",
           "SuffixProposer", "SuffixCache"]
