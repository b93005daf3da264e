"""Moving tensor bytes: unshard, gather, place, compose, write."""
