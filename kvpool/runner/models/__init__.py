"""The model implementations (Llama family, Gemma-3, LFM2, Mllama) and the registry that picks one by the
Hugging Face config's architecture (see `registry.py`)."""
