"""The vocabulary every stage shares, no I/O: specs, dtypes, sizes, layouts."""
