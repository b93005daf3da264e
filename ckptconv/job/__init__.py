"""The process and its ranks: world, ui, environment, signals, read budget."""
