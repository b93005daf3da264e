"""Save_hf / load_hf inside a training job, from and into a live sharded model."""
