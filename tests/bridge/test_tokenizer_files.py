"""The tokenizer files of a model directory are copied into outputs that are kept and shared (the
engine's model directory, a converted checkpoint's hf_config/, the Hugging Face export). A file
that is a symbolic link out of the directory is refused by name and nothing of it is copied;
before, `tokenizer_config.json -> ~/.netrc` in a downloaded model put the linked file's bytes
into those outputs. A hub cache snapshot's links into its repository's blobs/ are followed."""

from __future__ import annotations

import os

import pytest

from megatron_rl.bridge.hf_checkpoint import copy_tokenizer_files
from megatron_rl.errors import ConfigError


def test_a_tokenizer_file_linked_out_of_the_model_is_refused_and_not_copied(tmp_path):
    secret = tmp_path / "netrc"
    secret.write_text("machine example.com password hunter2\n")
    model, out = tmp_path / "model", tmp_path / "out"
    model.mkdir()
    out.mkdir()
    (model / "tokenizer.json").write_text("{}")
    os.symlink(secret, model / "tokenizer_config.json")
    with pytest.raises(ConfigError) as refused:
        copy_tokenizer_files(model, out)
    assert str(refused.value).startswith(f"tokenizer file {model}/tokenizer_config.json leads outside {model} "
                                         f"(through a symbolic link) (to {secret})"), refused.value
    assert list(out.iterdir()) == []  # not even the plain tokenizer.json: checked before any is copied


def test_plain_files_and_a_hub_cache_snapshots_links_are_copied(tmp_path):
    repository = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs, out = repository / "snapshots" / "abc123", repository / "blobs", tmp_path / "out"
    for directory in (snapshot, blobs, out):
        directory.mkdir(parents=True)
    (blobs / "f00d").write_text('{"model_max_length": 512}')
    os.symlink("../../blobs/f00d", snapshot / "tokenizer_config.json")
    (snapshot / "tokenizer.json").write_text("{}")
    assert copy_tokenizer_files(snapshot, out) == ["tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 512}'
