"""Speculative decoding (vLLM's name for it), above the engine: `LLM` hands the engine a Speculator.

speculator.py proposes drafts before a step and verifies them after it; ngram.py and draft.py are
the proposers (prompt n-grams, a draft model with its own engine); rejection.py keeps the target's
distribution exactly; adaptive.py chooses K each step from measured costs.
"""
