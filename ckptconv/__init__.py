"""ckptconv: convert LLM checkpoints between PyTorch DCP and Hugging Face safetensors, on one rank or many."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`ckptconv.save_hf`, `ckptconv.load_hf`, `ckptconv.LoadSpec`: imported on first use (torch is slow to
    import, and `ckptconv --help` should not pay for it)."""
    if name in ("save_hf", "load_specs", "LoadSpec", "SaveReport"):
        from ckptconv.live import save as live

        return getattr(live, name)
    if name in ("load_hf", "LoadReport"):
        from ckptconv.live import load as live_load

        return getattr(live_load, name)
    raise AttributeError(f"module 'ckptconv' has no attribute {name!r}")
