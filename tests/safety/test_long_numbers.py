"""A mapping TOML or a config.json holding an integer longer than Python converts (4300 digits): one line,
exit 2, naming the file, never the interpreter's ValueError."""

from __future__ import annotations

from pathlib import Path

from conftest import ckptconv
from test_bad_input import assert_one_line


def test_a_5000_digit_integer_in_a_mapping_or_config_is_one_line(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    mapping = tmp_path / "m.toml"
    mapping.write_text("[mapping]\nzzz = " + "9" * 5000 + '\n[[rule]]\nruntime = "a"\nhf = "b"\n')
    proc = ckptconv("inspect", str(fsdp2_ckpt), "--mapping", str(mapping))
    assert "Traceback" not in proc.stderr, proc.stderr
    assert_one_line(proc.returncode, proc.stderr, "m.toml", "more than 4300 digits", "fewer digits")
    config = tmp_path / "config.json"
    config.write_text('{"vocab_size": ' + "9" * 5000 + "}")
    out = tmp_path / "out"
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out), "--config", str(config))
    assert "Traceback" not in proc.stderr, proc.stderr
    assert_one_line(proc.returncode, proc.stderr, "config.json", "more than 4300 digits", "fewer digits")
    assert not out.exists()
