"""The decisions of playbooks/multinode-cutover.yml, in Python (Ansible loads a role's filters).

The play asks every host of a group for the preflight of its own nodes (`appliance cutover
GROUP IMAGE --check`, one JSON object per host); these filters turn those answers into
the move, or refuse it with one line. They run on the controller, which need not have the
appliance installed: plain Python, no import of it.
"""

from __future__ import annotations

import re

try:  # Ansible's own error type when Ansible loads this file; a plain one when tests import it.
    from ansible.errors import AnsibleFilterError as _Refused
except ImportError:  # pragma: no cover - tests import this file without Ansible's loader
    _Refused = ValueError


def multinode_plan(
    checks: dict[str, dict], image: str, canary: bool | str | None = None
) -> dict[str, object]:
    """The move of a group to ``image`` from ``checks`` ({host: its --check answer}).

    Returns ``head`` (the host of the head), ``head_unit`` (its unit: the head stops before
    any worker moves, since a worker started while a head runs joins that head's finished
    rendezvous and hangs there once the head restarts), ``workers`` (the worker hosts, by rank),
    ``move_workers`` (those not already running ``image``: they move first, one after the
    other), ``move_head`` (the head moves when it does not run ``image`` or any worker moves:
    a worker's restart leaves the head unable to generate until it restarts too),
    ``old_image`` (where every node goes back on failure: the image the head's env file names,
    the group's record being on the head) and ``split`` ({host: image} of the nodes naming
    another image than the head, left by a stopped play; this move brings them together) and
    ``canary`` (record the head's answers before any node moves and judge the head's new image
    against them: when the head moves and ``canary``, else the head's profile, says so; ``""``
    or None means the profile's).
    """
    if not checks:
        raise _Refused("no host of the group answered the preflight")
    heads = sorted(h for h, c in checks.items() if "head" in c["roles"])
    if len(heads) != 1:
        raise _Refused(
            f"the play's hosts run {len(heads)} heads ({', '.join(heads) or 'none'}): a group "
            "has one; set multinode_hosts to the hosts of ONE group"
        )
    head = heads[0]
    workers = sorted((h for h in checks if h != head), key=lambda h: checks[h]["ranks"])
    for h in workers:
        if not checks[h]["ranks"]:
            raise _Refused(f"{h} runs no node of group {checks[h]['name']}")
    expected = sorted(checks[head]["remote_ranks"])
    found = sorted(r for h in workers for r in checks[h]["ranks"])
    if found != expected:
        raise _Refused(
            f"the head on {head} waits for worker ranks {expected} on other hosts, the play's "
            f"worker hosts run ranks {found}: set multinode_hosts to every host of the group"
        )
    _one_image(checks, "image_id", image)
    old = checks[head]["env_image"]
    # Hosts a stopped move left on another image (run again to make the group whole): their
    # env file names no way back; the group's is the head's.
    split = {h: c["env_image"] for h, c in checks.items() if c["env_image"] != old}
    if old:  # the way back: every node back on one engine, or the head's gates wait in vain
        _one_image({h: c for h, c in checks.items() if h not in split}, "env_image_id", old)
    move_workers = [h for h in workers if not checks[h]["runs_image"]]
    move_head = bool(move_workers) or not checks[head]["runs_image"]
    wanted = checks[head].get("canary", False) if canary in (None, "") else _flag(canary)
    unit = checks[head].get("units", {}).get("head")
    if not unit:
        raise _Refused(
            f"{head} did not name its head's unit: an appliance older than this play; "
            "install the same appliance on every host of the group"
        )
    return {
        "head": head,
        "head_unit": unit,
        "workers": workers,
        "move_workers": move_workers,
        "move_head": move_head,
        # Only a whole group on the old image can answer: not on a first image, nor when a
        # stopped move left the nodes apart (the head cannot generate then).
        "canary": bool(move_head and wanted and old and not split),
        "old_image": old,
        "split": split,
    }


def _one_image(checks: dict[str, dict], key: str, image: str) -> None:
    """Refuse unless every host holds ``image`` as one image ID (``key`` of its answer: the
    new image's, or the way back's): the nodes of a group must run one engine."""
    ids = {h: c.get(key) or "absent" for h, c in checks.items()}
    if len(set(ids.values())) > 1:
        listing = ", ".join(f"{h}: {i[:19]}" for h, i in sorted(ids.items()))
        raise _Refused(
            f"{image} is a different image on different hosts ({listing}): the nodes would run "
            "different engines; load the same image everywhere (playbooks/rollout.yml's archive)"
        )


def _flag(value: bool | str) -> bool:
    """An Ansible extra var as a boolean (``-e multinode_canary=false`` arrives as text)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise _Refused(f"multinode_canary={value!r}: say true or false (or leave it unset)")


_ERROR = re.compile(r"^Error: .*$", re.MULTILINE)


def multinode_why(result: dict | None) -> str:
    """One line for a failed step's result (a loop's included): the appliance's ``Error:``
    lines, else Ansible's message."""
    if not result:
        return "failed"
    parts = [result, *result.get("results", [])]
    lines = [m for r in parts for m in _ERROR.findall(r.get("stderr") or "")]
    if lines:
        return " ".join(dict.fromkeys(lines))
    msgs = [r.get("msg") for r in parts if r.get("failed") or r.get("unreachable")]
    return next((str(m) for m in msgs if m), str(result.get("msg") or "failed"))


class FilterModule:
    """The role's filters."""

    def filters(self):
        return {"multinode_plan": multinode_plan, "multinode_why": multinode_why}
