"""Option types for where a command connects or listens: an engine's URL and a TCP port.

Checked as the command line is parsed, so a URL or port nothing can use is one ``Error:`` line
before any work (an engine booted, a bench started), never a traceback or a request to a host
the operator did not mean (``ftp://h`` read as a host called ``ftp``).
"""

from __future__ import annotations

import click

from ..engine_api.vllm_client import engine_url

# A TCP port, for an option that binds or connects one (vLLM's bind() refuses the rest, late).
PORT = click.IntRange(1, 65535)


class EngineUrl(click.ParamType):
    """An engine's base URL (every ``--url``-like option): http or https, a host, a port within
    1..65535; normalised (``http://h:p`` from ``h:p`` or ``http://h:p/v1``)."""

    name = "url"

    def convert(self, value, param, ctx) -> str:
        label = param.opts[0] if isinstance(param, click.Option) else "URL"
        return engine_url(str(value), label)


ENGINE_URL = EngineUrl()
