"""Text in and out of token ids, independent of any weights: the tokenizer (`Tokenizer`, from a
Hugging Face folder or GGUF metadata; BERT's WordPiece in `wordpiece.py`), chat templates rendered in
a bounded sandbox (`chat_template.py`, `template_*.py`) and fill-in-the-middle prompts (`fim.py`)."""
