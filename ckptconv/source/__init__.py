"""What SRC is and how it is opened: local, URL, Hub, LoRA adapters, shared metadata, the reference model."""
