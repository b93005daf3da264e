"""Readers and writers of the checkpoint formats: DCP directories and Hugging Face safetensors."""
