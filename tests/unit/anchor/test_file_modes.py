"""Files hf-cfp writes get the mode `open()` would give them under the process umask: 0o666 & ~umask
(not the 0600 of tempfile.mkstemp and safetensors' save_file), so teammates can read shared anchors."""

import os
import stat

import pytest
from support.tiny import anchor_for, tiny_llama

from hf_cfp.anchor.storage import current_umask
from hf_cfp.protection import CFPState, save_theta0


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_current_umask_reads_the_process_umask(umask):
    assert current_umask() == umask
    assert current_umask() == umask  # reading it changed nothing


@pytest.mark.parametrize("max_shard_size", ["5GB", "8KB"])  # one file; shards plus their index
def test_anchor_files_get_the_umask_mode(umask, tmp_path, max_shard_size):
    (tmp_path / "opened").open("x").close()  # the reference: what open() creates under this umask
    anchor_for(tiny_llama()).save_pretrained(tmp_path / "anchor", max_shard_size=max_shard_size)
    files = sorted((tmp_path / "anchor").iterdir())
    assert ("fisher.safetensors.index.json" in [f.name for f in files]) == (max_shard_size == "8KB")
    assert len(files) >= 2 and "cfp_config.json" in [f.name for f in files]
    assert {f.name: mode(f) for f in files} == {f.name: 0o666 & ~umask for f in files}
    assert mode(tmp_path / "opened") == 0o666 & ~umask


def test_checkpoint_theta0_files_get_the_umask_mode(umask, tmp_path):
    model = tiny_llama()
    save_theta0(CFPState(model, anchor_for(model)), tmp_path / "checkpoint-1")
    files = list((tmp_path / "checkpoint-1").iterdir())
    assert [f.name for f in files] == ["cfp_theta0-rank00000-of-00001.safetensors"]
    assert mode(files[0]) == 0o666 & ~umask
