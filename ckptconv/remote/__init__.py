"""Checkpoints in object storage (`s3://`, `gs://`, `az://`, any fsspec protocol): URLs, ranged reads."""
