"""A group is watched like an instance: ``multinode install`` puts the
head in this host's scrape targets (a worker serves no API), and status names the group's real
units. The same under real systemd, with the state metrics: tests/test_multinode_systemd.py."""

from __future__ import annotations

import json

from plugins.cli import invoke

from appliance import units
from appliance.host.layout import Layout

INSTALL = ["instance", "install", "g31", "-p", "spark2-31b-nvfp4-mtp", "--port", "8061"]


def _install(root, *extra: str) -> None:
    invoke([*INSTALL, *extra, "--root", str(root)])


def test_the_heads_host_scrapes_the_head_and_a_workers_host_nothing(tmp_path):
    head, worker = tmp_path / "head", tmp_path / "worker"
    _install(head, "--role", "head")
    _install(worker, "--role", "worker", "--rank", "1")
    groups = json.loads(units.writer.scrape_targets_file(head).read_text())
    assert groups == [
        {"targets": ["127.0.0.1:8061"],
         "labels": {"instance": "g31", "profile": "spark2-31b-nvfp4-mtp"}},
    ]  # fmt: skip
    assert not units.writer.scrape_targets_file(worker).exists()


def test_a_group_is_served_by_its_head_and_worker_units_not_an_instance_unit(tmp_path):
    _install(tmp_path, "--role", "head")
    assert Layout(tmp_path).shape("g31").units == ("gemma4-vllm-head@g31.service",)
    _install(tmp_path, "--role", "worker", "--rank", "1")
    assert Layout(tmp_path).shape("g31").units == (
        "gemma4-vllm-head@g31.service", "gemma4-vllm-worker@g31.service"
    )  # fmt: skip
    units.install("cpu-tiny-mtp", "tiny", root=tmp_path)
    assert Layout(tmp_path).shape("tiny").units == ("gemma4-vllm@tiny.service",)
