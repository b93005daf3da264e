"""ckptconv: convert LLM checkpoints between PyTorch DCP and Hugging Face safetensors, on one rank or many."""

__version__ = "0.1.0"
