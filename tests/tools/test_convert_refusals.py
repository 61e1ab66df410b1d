"""`convert hf-to-megatron` names its own flag for a model directory that is not there: the
message said `model.hf_config`, a config key the command does not have."""

from __future__ import annotations

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.tools import convert


def test_a_missing_hf_dir_is_named_by_its_flag(tmp_path):
    missing, out = tmp_path / "Qwen3-30B-A3B", tmp_path / "out"
    with pytest.raises(ConfigError, match=rf"^--hf-dir: {missing} is neither a preset \(") as raised:
        convert.hf_to_megatron(["--hf-dir", str(missing), "--out", str(out)])
    assert "model.hf_config" not in str(raised.value)
    assert not out.exists()
