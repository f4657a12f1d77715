"""Cutover and rollback of a serving instance: the env file, the gates, the history, the lock.

A cutover is, underneath, what an operator could do by hand: set ``VLLM_IMAGE`` in
``/etc/gemma4-vllm/<instance>.env`` and ``systemctl restart gemma4-vllm@<instance>``. This
package adds what the hand path lacks: checks before the service is touched, health gates after
the restart, an automatic way back, one cutover at a time per instance, and a history.

One job per module: ``paths`` (where things live), ``envfile`` (atomic env file edits),
``history`` (append-only JSONL), ``lock`` (per-instance flock), ``systemd`` (systemctl and
journalctl), ``gates`` (is the new engine really serving), ``flow`` (the state machine).
"""
