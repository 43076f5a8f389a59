from .base import NoProposer, Proposer
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer

__all__ = ["Proposer", "NoProposer", "PromptLookupProposer", "DraftModelProposer"]
