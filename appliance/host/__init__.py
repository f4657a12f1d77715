"""The host's side of every instance: its names, the env file the unit reads, the appliance's
state folders, the per-instance lock and systemd. Units, models, cutover and doctor all build on
this package; it imports none of them (the layers run one way).

- :mod:`.names`: the instance name rule and what it names (unit, container, folders).
- :mod:`.envfile`: the one parser and byte-preserving editor of ``/etc/gemma4-vllm/NAME.env``.
- :mod:`.layout`: where the appliance keeps an instance's state under a root (``Layout``).
- :mod:`.lock`: one cutover, rollback or uninstall at a time per instance (``flock``).
- :mod:`.apikey`: the one reader of an instance's API key file, with one rule for every caller.
- :mod:`.systemd`: ``systemctl`` and ``journalctl``, with a test root prefix.
"""
