"""The commands a user runs, each as named steps: dcp-to-hf, hf-to-dcp, verify, inspect."""
