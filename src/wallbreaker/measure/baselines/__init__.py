"""Other engines run on the same model and workload, for side-by-side figures: llama.cpp's own
benchmark tools, and Hugging Face transformers' `generate` on the dequantized weights."""
