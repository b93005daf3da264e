"""A Megatron-FSDP tensor key that is the model prefix alone (`model.module.`, nothing after it) names a
tensor with an empty name: refused in one line as an empty name is anywhere, not skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_bad_input import assert_one_line, run
from test_megatron_fsdp_read import SAVE


def test_a_key_that_is_the_prefix_alone_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = SAVE.state(False, 2)
    state["model"]["module."] = torch.ones(3)
    with pytest.warns(UserWarning):  # no process group: dcp.save says it saves in one process
        dcp.save(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "c"), str(tmp_path / "out"))
    assert_one_line(code, err, str(tmp_path / "c"), "empty name", "'model.module.'")
    assert not (tmp_path / "out").exists()
