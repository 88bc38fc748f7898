"""wallbreaker: an LLM inference engine on PyTorch."""
