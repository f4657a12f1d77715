"""The real engine serves models laid by ``appliance models import``, offline, by repo id.

What an installed GPU instance does: HF_HOME is the instance's cache, HF_HUB_OFFLINE=1, and
vLLM is given the hub repo ids of the target and the drafter. Here the cache was filled by
exporting from a cache pulled from the local hub and importing into an empty one.
"""

from __future__ import annotations

import httpx
import pytest
from plugins.hub import DRAFTER_REPO, HUB_TOKEN, TARGET_REPO
from test_models import PROFILE_TOML, _args

from appliance import profiles
from appliance.engine import local

pytestmark = pytest.mark.engine


# Its own engine only: the machines stream runs it (tests/conftest.py), early.
@pytest.mark.own_engines
def test_imported_cache_serves_target_and_mtp_drafter_offline(tmp_path, local_hub, cli_run):
    token_file = tmp_path / "hf-token"
    token_file.write_text(HUB_TOKEN)
    token_file.chmod(0o600)
    profile_file = tmp_path / "tiny-hub-mtp.toml"
    profile_file.write_text(PROFILE_TOML)
    source, fresh, copy = tmp_path / "source", tmp_path / "fresh", tmp_path / "copy.tar"
    env = {"HF_ENDPOINT": local_hub.url}
    for args in (
        ["pull", *_args(profile_file, source), "--token-file", str(token_file)],
        ["export", *_args(profile_file, source), "--to", str(copy)],
        ["import", *_args(profile_file, fresh), "--from", str(copy)],
        ["verify", *_args(profile_file, fresh)],
    ):
        cli_run(["models", *args], env=env)
    n_requests = len(local_hub.log)

    prof = profiles.load_file(profile_file)
    assert (prof.model, prof.speculative.model) == (TARGET_REPO, DRAFTER_REPO)
    # HF_HOME is the imported cache and nothing may reach a hub: the offline env of every
    # instance (local.OFFLINE_ENV), plus an endpoint that refuses connections.
    offline = {"HF_HOME": str(fresh), "HF_ENDPOINT": "http://127.0.0.1:9"}
    with local.serve(prof, env=offline, timeout=900) as eng:
        log = eng.log_path.read_text(errors="replace")
        assert "Gemma4 MTP" in log or "gemma4_mtp" in log.lower()
        with httpx.Client(timeout=120) as client:
            body = {
                "model": prof.served_model_name,
                "messages": [{"role": "user", "content": "hello hello hello"}],
                "max_tokens": 24,
                "temperature": 0,
            }
            r = client.post(eng.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] > 0
            metrics = client.get(eng.url + "/metrics").text
    accepted = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_accepted_tokens_total{")
    ]
    assert accepted and accepted[0] > 0  # the imported copy drafter drafts, and is accepted
    assert len(local_hub.log) == n_requests  # the engine never asked the hub for anything
