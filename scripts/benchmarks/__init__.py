"""ckptconv's benchmarks, one module each, run through `scripts/bench.py NAME [options]`:

  convert   dcp-to-hf and hf-to-dcp against `cp -r`, the start-up floors and plain PyTorch recipes
            (dense and MoE-shaped checkpoints made by a real FSDP2 job; time, GB/s, peak RSS per rank)
  memory    peak RSS per rank of `verify`, `dcp-to-hf --verify` and `--read gather` against their bounds
  durable   what fsync costs: both directions with and without `--no-fsync`, against torch's default paths
            (dcp.save fsyncs, save_torch_state_dict does not) and the same paths made durable
  plan      planning at scale without the data: a synthetic 0.85 TB, 512-rank checkpoint's `.metadata`
  lora      `dcp-to-hf --lora merge` against PEFT's merge_and_unload + save_pretrained
  s3        dcp-to-hf from and to object storage (a local moto server) against get, convert, put
  save-hf   `ckptconv.save_hf` in a simulated FSDP2 training job against full_tensor + a rank-0 save
  scaling   dcp-to-hf and hf-to-dcp at 1 to 8 ranks where the cores exist, save_hf / load_hf on GPUs
            (scripts/scaling.sh on a machine with many cores and a GPU)

The shared pieces: runner.py (each command a fresh subprocess under an RSS monitor of its process tree,
several methods interleaved over `--runs`, the median; `--out FILE`, the results file with the machine, the
versions and the date), methods.py (the conversion methods' command lines), checkpoints.py (the benchmark
checkpoints, made once into the work directory), suite.py and tables.py (the conversion benchmarks' loop and
reports). workers/ holds the scripts the benchmarks run by path: the checkpoint generator and the baselines.
docs/benchmarks/*.json are published results files, plotted on the docs site's benchmarks page.
"""
