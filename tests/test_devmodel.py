"""`appliance dev devmodel`: deterministic, offline, and loud about bad directories."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from pathlib import Path

from plugins.cli import invoke

from appliance.engine import devmodel


def run(*args):
    return invoke(list(args), code=None)


def _weight_digest(root: Path) -> str:
    """SHA-256 over every weight file of a pair, to compare two builds."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.safetensors")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        result = run("dev", "devmodel", str(tmp_path / name), "--seed", str(seed))
        assert result.exit_code == 0, result.output
    digest = {n: _weight_digest(tmp_path / n) for n in "abc"}
    assert digest["a"] == digest["b"]
    assert digest["a"] != digest["c"]


def test_pair_layout_is_what_vllm_mtp_expects(tmp_path):
    model = devmodel.build(tmp_path / "m", drafter="random", seed=1)
    target = json.loads((model.target / "config.json").read_text())
    drafter = json.loads((model.drafter / "config.json").read_text())
    assert target["model_type"] == "gemma4_text" and target["global_head_dim"] == 32
    assert drafter["model_type"] == "gemma4_assistant"
    assert drafter["text_config"]["global_head_dim"] == 32
    assert drafter["backbone_hidden_size"] == target["hidden_size"]
    assert (
        drafter["text_config"]["num_kv_shared_layers"]
        == drafter["text_config"]["num_hidden_layers"]
    )
    for d in (model.target, model.drafter):
        assert (d / "tokenizer.json").exists() and (d / "model.safetensors").stat().st_mode & 0o044
    assert (
        "chat_template" in (model.target / "tokenizer_config.json").read_text()
        or (model.target / "chat_template.jinja").exists()
    )


def test_copy_and_random_drafters_differ_but_share_the_target(tmp_path):
    copy = devmodel.build(tmp_path / "copy", drafter="copy", seed=3)
    rand = devmodel.build(tmp_path / "rand", drafter="random", seed=3)
    assert (copy.target / "model.safetensors").read_bytes() == (
        rand.target / "model.safetensors"
    ).read_bytes()
    assert (copy.drafter / "model.safetensors").read_bytes() != (
        rand.drafter / "model.safetensors"
    ).read_bytes()


def test_non_empty_directory_is_refused_with_one_line_and_exit_2(tmp_path, cli_run):
    (tmp_path / "keep.txt").write_text("mine")
    result = cli_run(["dev", "devmodel", str(tmp_path)], code=2)
    assert result.output.strip().count("\n") == 0
    assert result.output.startswith("Error: ") and "not empty" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_unwritable_directory_is_refused_with_one_line_and_exit_2(tmp_path, cli_run):
    # /proc refuses new directories even to root: a real unwritable place.
    result = cli_run(["dev", "devmodel", "/proc/appliance-test/tiny"], code=2)
    assert result.output.startswith("Error: cannot write to /proc/appliance-test")
    assert result.output.strip().count("\n") == 0


def test_unknown_drafter_kind_is_a_usage_error(tmp_path, cli_run):
    cli_run(["dev", "devmodel", str(tmp_path / "x"), "--drafter", "eh"], code=2)
    assert not (tmp_path / "x").exists()


def test_partial_drafter_is_the_copy_drafter_plus_a_read_of_the_hidden_state(tmp_path):
    from safetensors.torch import load_file

    copy = load_file(
        devmodel.build(tmp_path / "c", drafter="copy", seed=3).drafter / "model.safetensors"
    )
    part = devmodel.build(tmp_path / "p", drafter="partial", seed=3)
    again = devmodel.build(tmp_path / "q", drafter="partial", seed=3)
    assert _weight_digest(part.root) == _weight_digest(again.root)
    assert devmodel.load(part.root).drafter_kind == "partial"
    weights = load_file(part.drafter / "model.safetensors")
    changed = {k for k in copy if not (copy[k] == weights[k]).all()}
    assert changed == {"pre_projection.weight", "post_projection.weight"}
    pre, hidden = weights["pre_projection.weight"], devmodel.TARGET_HIDDEN
    # The token half is the copy drafter's; the hidden half (zero in copy) now reads the state.
    assert (pre[:, :hidden] == copy["pre_projection.weight"][:, :hidden]).all()
    assert not copy["pre_projection.weight"][:, hidden:].any() and pre[:, hidden:].any()


def test_builders_racing_for_one_cache_entry_all_get_it(tmp_path, monkeypatch):
    """The prefetch and the first tests of both streams build the same pair at once on a new
    machine: the builders whose rename came second found the winner's pair where they had seen
    none, and the soak failed on 'Directory not empty'. Each gets the one pair now.

    Four threads race the same renames four processes would (the file system decides), and
    wait for each other after writing their pairs, so every one of them renames onto a taken
    place but the first; processes cost each an import of torch and transformers (17-115 s of
    the suite for the same race)."""
    # One build first, in this thread: transformers' lazy imports fail when threads race them.
    devmodel.build(tmp_path / "first")
    cache = tmp_path / "cache"
    everyone_built = threading.Barrier(4, timeout=120)
    write_pair = devmodel._write_pair

    def write_then_wait(*args):
        try:
            write_pair(*args)
        except BaseException:
            everyone_built.abort()  # the others fail now, not at the timeout
            raise
        everyone_built.wait()

    monkeypatch.setattr(devmodel, "_write_pair", write_then_wait)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        pairs = list(pool.map(lambda _: devmodel.cached("copy", 0, cache_dir=cache), range(4)))
    assert len({p.root for p in pairs}) == 1, pairs
    assert devmodel.load(pairs[0].root).drafter_kind == "copy"
    assert [p.name for p in cache.iterdir()] == [pairs[0].root.name]  # no staging left
