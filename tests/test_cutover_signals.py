"""The cutover's signal guard with real signals sent to this process (fast tier).

Under real systemd, with the real CLI, the signals are proven in tests/test_cutover_interrupt.py;
this pins the guard's three modes and that it puts the old handlers back.
"""

from __future__ import annotations

import os
import signal

import pytest

from appliance.cutover.signals import Interrupted, guard


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_raise_defer_and_hold(sig):
    before = signal.getsignal(sig)
    # A hang-up detaches only a terminal (nohup's /dev/null): pytest's captured fds are files.
    fds = [os.fstat(fd) for fd in (1, 2)]
    notes: list[str] = []
    with guard(notes.append) as g:
        with pytest.raises(Interrupted) as caught:
            os.kill(os.getpid(), sig)
        assert caught.value.name == sig.name
        # After the first one: held, a second signal is noted, never raised.
        os.kill(os.getpid(), sig)
        assert notes and "ignored, going on" in notes[-1]
        g.defer()
        os.kill(os.getpid(), sig)  # kept ...
        with pytest.raises(Interrupted):
            g.arm()  # ... and raised where the flow can take it
        assert g.received == [sig.name] * 3
        # The way back says how long it may still take: the --timeout bounds it.
        g.hold(within=90)
        os.kill(os.getpid(), sig)
        assert notes[-1].endswith("ignored, going on (it ends within 90 s, the --timeout)")
    assert signal.getsignal(sig) == before
    assert all(os.path.samestat(a, os.fstat(fd)) for a, fd in zip(fds, (1, 2), strict=True))
