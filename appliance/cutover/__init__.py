"""Cutover and rollback of a serving instance: the env file, the gates, the history, the lock.

A cutover is, underneath, what an operator could do by hand: set ``VLLM_IMAGE`` in
``/etc/gemma4-vllm/<instance>.env`` and ``systemctl restart gemma4-vllm@<instance>``. This
package adds what the hand path lacks: checks before the service is touched, health gates after
the restart, an automatic way back, one cutover at a time per instance, and a history.

One job per module: ``context`` (what a cutover talks to), ``preflight`` (the checks before
anything is touched), ``flow`` (the state machine), ``gates`` (is the new engine really serving),
``slot`` (the rollback target), ``recovery`` (``rollback``, and a killed cutover's recovery),
``history`` (append-only JSONL), ``signals`` (Ctrl-C, TERM and a hang-up become the way back),
``status`` and ``metrics`` (what an operator and Prometheus read). The host's env file, lock and
systemd calls are :mod:`appliance.host`'s.
"""
