"""node_exporter keeps the distribution's textfile directory beside the appliance's state file
(issue 56 §4, ecosystem review E12).

Debian's node_exporter (1.5 in Debian 12) has /var/lib/prometheus/node-exporter compiled in,
where prometheus-node-exporter-collectors write, and takes --collector.textfile.directory once
before 1.9 (the flag repeats from 1.9, prometheus/node_exporter#3135): the flag set to the
appliance's folder alone silently drops the distribution's metrics. Every text the appliance
ships that tells how node_exporter reads the state file keeps both."""

from __future__ import annotations

import re
from pathlib import Path

from appliance.host.layout import Layout
from appliance.hostcheck import system
from appliance.observability import generate, rules
from appliance.observability.names import DEBIAN_TEXTFILE_DIR
from appliance.units import template

REPO = Path(__file__).resolve().parents[1]
TEXTFILE = Layout(Path("/")).metrics_textfile()
FLAG = "--collector.textfile.directory="
OURS = f"{FLAG}{TEXTFILE.parent}"
FENCE = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _monitoring() -> str:
    text = (REPO / "README.md").read_text()
    return text[text.index("### Monitoring") :].split("\n### ", 1)[0]


def test_the_readme_links_the_state_file_into_debians_directory_and_keeps_it():
    section = _monitoring()
    (block,) = [b for b in FENCE.findall(section) if "node-exporter" in b]
    lines = [line.strip() for line in block.splitlines()]
    assert f"ln -s {TEXTFILE} {DEBIAN_TEXTFILE_DIR}/" in lines
    # node_exporter's own arguments leave its textfile directory as Debian built it.
    (args,) = [line for line in lines if "ARGS=" in line]
    assert args.endswith('ARGS="--web.listen-address=127.0.0.1:9100"')
    assert "systemctl restart prometheus-node-exporter" in lines
    # The repeated flag, for node_exporter 1.9 and later, names both directories.
    prose = " ".join(FENCE.sub("", section).split())
    repeated = f"`{FLAG}{DEBIAN_TEXTFILE_DIR} {OURS}`"
    assert (
        f"From node_exporter 1.9 the flag may be repeated instead, one per directory: {repeated}"
        in prose
    )


def _shipped() -> dict[str, str]:
    """What the appliance ships that an operator reads: the docs, the generated rules and unit
    examples, what `instance install` writes, the Ansible role."""
    out = {}
    for pattern in ("README.md", "adr/*.md", "docs/*.md", "gotchas/*.md", "systemd/*"):
        out |= {str(p.relative_to(REPO)): p.read_text() for p in REPO.glob(pattern) if p.is_file()}
    for path in sorted((REPO / "deploy").rglob("*")):
        if path.is_file() and path.suffix in (".md", ".yml", ".yaml", ".j2", ".cfg", ".ini"):
            out[str(path.relative_to(REPO))] = path.read_text()
    out |= {p: t for p, t in generate.outputs().items() if p.startswith("prometheus/rules/")}
    out |= {f"install: {p}": str(f.content) for p, f in template.state_units().items()}
    return out


def test_no_shipped_text_gives_node_exporter_the_appliances_folder_alone():
    """Wherever the flag is given the appliance's folder, Debian's is named beside it (in the
    same paragraph, the same comment block of a unit, the same line of YAML)."""
    shipped = _shipped()
    assert {"README.md", "systemd/gemma4-appliance-state.service"} <= shipped.keys()
    bad, found = [], 0
    for name, text in shipped.items():
        # A rule file's every line is a rule's field: judged alone.
        yaml_file = name.endswith((".yml", ".yaml"))
        for para in text.splitlines() if yaml_file else re.split(r"\n\s*\n", text):
            if OURS in para:
                found += 1
                if DEBIAN_TEXTFILE_DIR not in para:
                    bad.append(f"{name}: {para.strip()[:300]}")
            for args in re.findall(r'ARGS="([^"]*)"', para):
                dirs = [w.removeprefix(FLAG) for w in args.split() if w.startswith(FLAG)]
                assert dirs in ([], [DEBIAN_TEXTFILE_DIR, str(TEXTFILE.parent)]), (name, args)
    assert not bad, "\n".join(bad)
    # The README, the state unit (its example and what install writes), the alert: all say it.
    assert found >= 5


def test_the_alert_and_the_host_check_say_to_link_the_file():
    (missing,) = [r for r in rules.all_rules() if r.name == "Gemma4StateTextfileMissing"]
    desc = missing.annotations["description"]
    assert f"link {TEXTFILE} into its textfile directory (Debian's {DEBIAN_TEXTFILE_DIR})" in desc
    assert f"from node_exporter 1.9 add {OURS} beside the flag of that directory" in desc
    found = system.node_exporter_finding()  # no node_exporter on this machine
    assert found.status == "warn"
    assert "link the state textfile into its textfile directory" in found.fix
    assert FLAG not in found.fix
