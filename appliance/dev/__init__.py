"""The developer's tools beside the operator's commands (``appliance dev``).

- :mod:`.demo`: real chat completions against the real engine, through the telemetry agent;
- :mod:`.generate`: the one generator of every committed generated file, and its drift check.

The tiny models the demo serves and the engine that runs them are :mod:`appliance.engine`'s.
"""
