"""Drafts for speculative decoding: the MTP head, copies from the context (prompt lookup), and the policy
that picks one per cycle and adapts draft lengths to what was accepted."""

from .base import LOOKUP, MTP, SOURCES, Draft, draft_distributions
from .lookup import NGramIndex
from .policy import (
    DEFAULT_LOOKUP_K,
    DEFAULT_MODE,
    DEFAULT_NGRAM,
    MODES,
    AdaptiveLength,
    Drafter,
    DraftPolicy,
    DraftSettings,
    LookupDrafter,
    MTPDrafter,
)

__all__ = [
    "DEFAULT_LOOKUP_K",
    "DEFAULT_MODE",
    "DEFAULT_NGRAM",
    "LOOKUP",
    "MODES",
    "MTP",
    "SOURCES",
    "AdaptiveLength",
    "Draft",
    "DraftPolicy",
    "DraftSettings",
    "Drafter",
    "LookupDrafter",
    "MTPDrafter",
    "NGramIndex",
    "draft_distributions",
]
