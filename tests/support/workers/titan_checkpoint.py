"""A training checkpoint written by torchtitan 0.3.0's own CheckpointManager, under torchrun (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc-per-node 2 titan_checkpoint.py CONFIG_JSON OUT

CONFIG_JSON: the HF config.json of a tiny Llama (families.py); the torchtitan llama3 model is built from
it with titan_adapter.llama3, torchtitan's own config helpers. Every rank builds it on the meta device,
shards it with torchtitan's `apply_fsdp_to_decoder` (FSDP2 `fully_shard` per block and root on a 1-D CPU
mesh of all ranks), materialises it with `init_weights`, as torchtitan's Trainer does, and takes one
training step as Trainer.train_step does: torchtitan's OptimizersContainer (`default_adamw`, for-loop
implementation: the fused one is CUDA only) and LRSchedulersContainer (warmup, linear decay), loss from
torchtitan's CrossEntropyLoss, a batch from torchtitan's ParallelAwareDataloader (torchdata's
StatefulDataLoader, from the pinned torchdata of tests/support/titan-requirements.txt) over a tiny in-memory
IterableDataset whose state_dict has the fields of torchtitan's HuggingFaceTextDataset (which itself needs
the `datasets` package and a corpus on disk). Two departures, neither of which changes what is saved: the
layers' inner attention is torchtitan's ScaledDotProductAttention instead of FlexAttention (which has no
backward on CPU; inner attention holds no state), and the FSDP modules reduce gradients with a plain SUM
(`set_force_sum_reduction_for_comms`: gloo has no PREMUL_SUM, which torchtitan's divide factor of 1 asks
for; the gradients are the same). Then:

- OUT/checkpoint/step-1: `CheckpointManager.save(1)` with states={"train_state": trainer}, where trainer
  returns exactly what torchtitan's Trainer.state_dict() returns: {"step": int, "ntokens_seen": int}.
- OUT/tensor_step/checkpoint/step-1: the same save, with the step as older torchtitan's TrainState stored
  it, a 0-d int32 tensor: {"step": tensor(1, int32), "ntokens_seen": int}.
- OUT/expected.pt (rank 0; torch.save, loadable with weights_only=True): "model": the full (unsharded) model
  state dict with torchtitan's names, "train_state": Trainer.state_dict(), "lr_scheduler":
  LRSchedulersContainer.state_dict(), "dataloader": every rank's dataloader state_dict merged (as
  CheckpointManager saves it: dp_rank_N pickled bytes and world_size), "optimizer": the keys of the
  flattened optimizer state dict.

support/titan.py runs this with the torchtitan install on PYTHONPATH; it is not importable from the main venv.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _finish import finish
from titan_adapter import llama3

STEP = 1
SEQ_LEN = 8
BATCH = 2


def _normalize(positions: list[int]) -> list[int]:
    """HuggingFaceTextDataset._normalize_positions: a window that starts inside a document starts at 0."""
    offset = positions[0]
    for i, p in enumerate(positions):
        if p == 0:
            break
        positions[i] = p - offset
    return positions


class TokenDataset(IterableDataset, Stateful):
    """Fixed token documents packed into SEQ_LEN windows with per-document positions, as torchtitan's
    HuggingFaceTextDataset packs them; its state_dict has that dataset's fields for a map-style source."""

    def __init__(self, rank: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(100 + rank)
        # other lengths per rank, so that the ranks' states differ after a step
        lengths = (11, 7, 13, 9, 17, 6) if rank % 2 == 0 else (5, 9, 12, 8, 14, 10)
        self.docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
        self._sample_idx = 0
        self._epoch = 0
        self._inputs_buffer: list[int] = []
        self._labels_buffer: list[int] = []
        self._positions_buffer: list[int] = []

    def __iter__(self):
        while self._sample_idx < len(self.docs):
            doc = self.docs[self._sample_idx]
            self._sample_idx += 1
            self._inputs_buffer += doc[:-1]
            self._labels_buffer += doc[1:]
            self._positions_buffer += list(range(len(doc) - 1))
            while len(self._inputs_buffer) >= SEQ_LEN:
                inputs = torch.LongTensor(self._inputs_buffer[:SEQ_LEN])
                labels = torch.LongTensor(self._labels_buffer[:SEQ_LEN])
                positions = torch.LongTensor(_normalize(self._positions_buffer[:SEQ_LEN]))
                self._inputs_buffer = self._inputs_buffer[SEQ_LEN:]
                self._labels_buffer = self._labels_buffer[SEQ_LEN:]
                self._positions_buffer = self._positions_buffer[SEQ_LEN:]
                yield {"input": inputs, "positions": positions}, labels

    def state_dict(self) -> dict[str, Any]:
        return {
            "inputs_buffer": self._inputs_buffer,
            "labels_buffer": self._labels_buffer,
            "positions_buffer": self._positions_buffer,
            "sample_idx": self._sample_idx,
            "epoch": self._epoch,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inputs_buffer = state_dict["inputs_buffer"]
        self._labels_buffer = state_dict["labels_buffer"]
        self._positions_buffer = state_dict["positions_buffer"]
        self._sample_idx = state_dict["sample_idx"]
        self._epoch = state_dict["epoch"]


class TrainerState(Stateful):
    """What CheckpointManager sees of torchtitan's Trainer (states={"train_state": trainer}): its
    state_dict/load_state_dict, torchtitan/trainer.py. `tensor_step`: the step as older torchtitan's
    TrainState saved it, a 0-d int32 tensor."""

    def __init__(self, tensor_step: bool = False) -> None:
        self.step = 0
        self.ntokens_seen = 0
        self.tensor_step = tensor_step

    def state_dict(self) -> dict[str, Any]:
        step: Any = torch.tensor(self.step, dtype=torch.int32) if self.tensor_step else self.step
        return {"step": step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.ntokens_seen = state_dict["ntokens_seen"]


def main(config_json: str, out_arg: str) -> None:
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out_arg)
    hf = json.loads(Path(config_json).read_text())

    # Trainer.__init__: meta build, parallelize (FSDP only), to_empty, init_weights, train()
    model_config = llama3(hf)
    for layer in model_config.layers:  # FlexAttention has no backward on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = model_config.build()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(
        model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False
    )
    for module in model.modules():  # gloo has no PREMUL_SUM: the same gradients by SUM (factor 1)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    optimizers = dataclasses.replace(default_adamw(lr=1e-2), implementation="for-loop").build(
        model_parts=[model]
    )
    lr_config = LRSchedulersContainer.Config(warmup_steps=2)
    lr_schedulers = lr_config.build(optimizers=optimizers, training_steps=10)
    dataloader = ParallelAwareDataloader(
        TokenDataset(rank, hf["vocab_size"]),
        dp_rank=rank,
        dp_world_size=world,
        batch_size=BATCH,
        snapshot_every_n_steps=1,
    )
    loss_fn = CrossEntropyLoss.Config().build()
    trainer = TrainerState()

    # Trainer.train_step, one step, no gradient accumulation
    batches = iter(dataloader)
    for _ in range(STEP):
        trainer.step += 1
        input_dict, labels = next(batches)
        positions = input_dict["positions"]
        trainer.ntokens_seen += labels.numel()
        pred = model(input_dict["input"], positions=positions)
        loss, _ = loss_fn(pred, labels, torch.tensor(labels.numel() * world))
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()

    def save(base: Path, train_state: TrainerState) -> None:
        checkpointer = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1).build(
            dataloader=dataloader,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states={"train_state": train_state},
            sd_adapter=None,
            base_folder=str(base),
        )
        assert checkpointer.save(trainer.step)
        checkpointer.close()

    save(out, trainer)
    old = TrainerState(tensor_step=True)
    old.step, old.ntokens_seen = trainer.step, trainer.ntokens_seen
    save(out / "tensor_step", old)

    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    loaders: list[Any] = [None] * world
    dist.all_gather_object(loaders, dataloader.state_dict())
    optimizer_keys = sorted(optimizers.state_dict())
    if rank == 0:
        merged: dict[str, Any] = {}
        for state in loaders:
            merged.update(state)
        expected = {
            "model": full,
            "train_state": trainer.state_dict(),
            "lr_scheduler": lr_schedulers.state_dict(),
            "dataloader": merged,
            "optimizer": optimizer_keys,
        }
        torch.save(expected, out / "expected.pt")
    finish()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1], sys.argv[2])
