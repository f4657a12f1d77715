"""vLLM's model-info cache seeded from an image's answers (appliance/engine/model_info_cache.py).

The images' side (answers baked at the build, accepted by their vLLM) is in the docker tier:
tests/test_images_docker.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from appliance.engine import model_info_cache, vllm_main

ENTRY = "vllm-model_executor-models-gemma4-Gemma4ForCausalLM.json"
DRAFTER = "vllm-model_executor-models-gemma4_mtp-Gemma4MTP.json"


@pytest.fixture
def baked(tmp_path) -> Path:
    folder = tmp_path / "baked"
    folder.mkdir()
    (folder / ENTRY).write_text('{"hash": "0.32", "modelinfo": {}}')
    (folder / DRAFTER).write_text('{"hash": "mtp", "modelinfo": {}}')
    return folder


def test_missing_answers_are_written_and_equal_ones_left_alone(tmp_path, baked):
    root = tmp_path / "cache"
    assert model_info_cache.seed(root, baked) == [ENTRY, DRAFTER]
    entry = root / "modelinfos" / ENTRY
    assert entry.read_bytes() == (baked / ENTRY).read_bytes()
    inode = entry.stat().st_ino
    assert model_info_cache.seed(root, baked) == []
    assert entry.stat().st_ino == inode
    assert sorted(p.name for p in (root / "modelinfos").iterdir()) == sorted([ENTRY, DRAFTER])


def test_another_releases_answer_is_replaced_whole_and_the_rest_kept(tmp_path, baked):
    folder = tmp_path / "cache" / "modelinfos"
    folder.mkdir(parents=True)
    (folder / ENTRY).write_text('{"hash": "0.19", "modelinfo": {}}')  # the other image's
    (folder / "vllm-other-Model.json").write_text("{}")  # an answer the image does not have
    assert model_info_cache.seed(tmp_path / "cache", baked) == [ENTRY, DRAFTER]
    assert (folder / ENTRY).read_text() == '{"hash": "0.32", "modelinfo": {}}'
    assert (folder / "vllm-other-Model.json").read_text() == "{}"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary left


def test_nothing_baked_writes_nothing(tmp_path):
    assert model_info_cache.seed(tmp_path / "cache", tmp_path / "absent") == []
    assert not (tmp_path / "cache").exists()


def test_the_entry_point_starts_on_when_the_cache_cannot_be_written(
    tmp_path, baked, monkeypatch, capfd
):
    # The cache root is a file: no folder can be made in it (as a read-only mount would refuse).
    root = tmp_path / "cache"
    root.write_text("")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    monkeypatch.setattr(model_info_cache, "BAKED", baked)
    # The images run the entry point as a script: model_info_cache is a top-level module there.
    monkeypatch.setitem(sys.modules, "model_info_cache", model_info_cache)
    vllm_main._seed_model_info_cache()
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gemma4-appliance: vLLM's model-info cache not")
    assert "inspects each model in a subprocess" in err[0]


def test_the_entry_point_seeds_where_vllm_looks(tmp_path, baked, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.setattr(model_info_cache, "BAKED", baked)
    monkeypatch.setitem(sys.modules, "model_info_cache", model_info_cache)
    vllm_main._seed_model_info_cache()
    assert sorted(os.listdir(tmp_path / "vllm" / "modelinfos")) == sorted([ENTRY, DRAFTER])
