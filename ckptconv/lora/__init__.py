"""LoRA (and DoRA) factors in a training checkpoint: recognised by their PEFT names (`keys`), the adapter's
settings (`settings`), what each `--lora` mode makes of the checkpoint's keys (`select`), and the merge
W + scaling * (B @ A) of one block of rows (`merge`)."""
