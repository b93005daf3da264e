"""Pure planning: which tensors go to which file and rank, and in what order."""
