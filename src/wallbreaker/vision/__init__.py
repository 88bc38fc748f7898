"""Images in: decoding (images.py), each family's preprocessing (gemma3_preprocess.py), the vision
encoders and projectors (siglip.py, gemma3.py), and what the engine carries per image (inputs.py)."""
