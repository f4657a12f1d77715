"""Options shared by several command groups."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from pathlib import Path

import click

from .. import progress
from ..bench import prompts
from ..errors import UsageError
from ..fsutil import check_target
from ..instance import endpoint
from .addresses import ENGINE_URL

# One meaning everywhere: where the host's /etc and /var/lib are (an image being built, a test
# tree, or an nspawn machine's root seen from the host).
root_option = click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    show_default=True,
    envvar="APPLIANCE_ROOT",
    help="Prefix of the host's /etc and /var/lib (an image being built, a test tree).",
)


def _quiet(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        progress.set_verbosity(progress.QUIET)


# A command's own -q is the top level's (`appliance -q status` = `appliance status -q`): it sets
# the one verbosity (progress.py) that the command and the library read, never a flag of its own.
quiet_option = click.option(
    "-q",
    "--quiet",
    is_flag=True,
    expose_value=False,
    callback=_quiet,
    help="The same as `appliance -q`: results and errors only.",
)


class OutputPath(click.Path):
    """A path the command writes (a file, or a folder with ``directory``), checked as the
    command line is parsed: a place nothing can be written is one ``Error:`` line before any
    work (a bench's whole measurement), never a traceback after it."""

    def __init__(self, *, directory: bool = False) -> None:
        super().__init__(path_type=Path)
        self.directory = directory

    def convert(self, value, param, ctx) -> Path:
        path = super().convert(value, param, ctx)
        label = param.opts[0] if isinstance(param, click.Option) else param.human_readable_name
        return check_target(path, label, directory=self.directory)


class Seconds(click.ParamType):
    """A time limit in seconds (``--timeout``, ``--canary-timeout``): a finite number from
    ``least`` to ``most``. click's FloatRange lets ``nan``, ``inf`` and ``1e400`` through, and a
    deadline of NaN or infinity never comes (a gate that never passes waits forever)."""

    name = "seconds"

    def __init__(self, least: float = 1.0, most: float = 86400.0) -> None:
        self.least, self.most = least, most

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            seconds = float(value)  # a default, or a caller's number
        else:
            try:
                seconds = float(str(value).strip())
            except ValueError:
                seconds = math.nan
        if not (math.isfinite(seconds) and self.least <= seconds <= self.most):
            label = param.opts[0] if isinstance(param, click.Option) else "seconds"
            raise UsageError(
                f"{label} {value!r}: not a number of seconds from {self.least:g} to {self.most:g}"
            )
        return seconds


# Every time limit a command takes: one day at most, so a mistyped exponent is refused too.
SECONDS = Seconds()


def api_key_options(f):
    """``--api-key`` (or ``VLLM_API_KEY``) and ``--api-key-file``: doctor's and bench's."""
    f = click.option(
        "--api-key-file",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="File holding the API key vLLM requires on /v1 "
        "(an installed instance's is /etc/gemma4-vllm/<instance>.api-key).",
    )(f)
    # The key itself: never echoed, never shown as a default in --help.
    return click.option(
        "--api-key",
        default=None,
        envvar="VLLM_API_KEY",
        show_envvar=True,
        show_default=False,
        metavar="KEY",
        help="The API key itself (prefer --api-key-file: a command line is "
        "visible to other users).",
    )(f)


def prompt_options(f):
    """``--prompts SETS``, ``--prompt-file FILE`` and ``--limit N``: what bench and tune send.
    The command receives ``sets``, ``prompt_file`` and ``limit``."""
    f = click.option("--limit", type=int, default=None, help="First N prompts of each set.")(f)
    f = click.option(
        "--prompt-file",
        multiple=True,
        type=click.Path(path_type=Path),
        help='Your JSONL prompts ({"prompt": ...} or {"messages": [...]} per line).',
    )(f)
    return click.option(
        "--prompts",
        "sets",
        default=",".join(prompts.SHIPPED),
        show_default=True,
        help="Shipped prompt sets, comma-separated.",
    )(f)


def endpoint_options(
    *,
    profile_help: str,
    default_url: str | None = endpoint.DEFAULT_URL,
    named: bool = True,
    reports_not_asked: bool = False,
):
    """The one way to name an engine (doctor, bench, canary record): ``[NAME]``, ``--instance``,
    ``--url``, ``--profile``, ``--root`` and the API key options, handed to the command as one
    ``endpoint`` (:func:`appliance.instance.endpoint.resolve`). ``named=False``: only ``--profile``
    and the key, for commands that take their URLs in options of their own (bench compare, sweep).
    Under a tree's ``--root`` the instance's port is not asked without ``--url``
    (host/reach.py): a command refuses in one line, unless it ``reports_not_asked`` (doctor)."""

    def decorate(f):
        @functools.wraps(f)
        def wrapper(
            profile_name,
            api_key,
            api_key_file,
            name=None,
            instance=None,
            url=None,
            root=Path("/"),
            **kwargs,
        ):
            ctx = click.get_current_context()
            source = click.core.ParameterSource
            if (
                api_key
                and api_key_file
                and ctx.get_parameter_source("api_key") == source.COMMANDLINE
            ):
                raise UsageError("give --api-key or --api-key-file, not both")
            typed = ctx.get_parameter_source("url") == source.COMMANDLINE
            ep = endpoint.resolve(
                instance=endpoint.pick_instance(name, instance),
                url=url if typed else None,
                env_url=None if typed else url,
                profile_name=profile_name,
                api_key=api_key,
                api_key_file=api_key_file,
                root=root,
                default=default_url,
            )
            if not reports_not_asked:
                ep.require_reachable()
            return f(endpoint=ep, **kwargs)

        naming = [
            click.argument("name", required=False, metavar="[NAME]"),
            click.option(
                "--instance",
                default=None,
                metavar="NAME",
                hidden=True,  # an old synonym of NAME, kept working
                help="The installed instance (the same as NAME): its URL, profile and key.",
            ),
            click.option(
                "--url",
                type=ENGINE_URL,
                default=None,
                envvar="APPLIANCE_URL",
                show_envvar=True,
                help="An engine's base URL; wins over the instance's "
                f"[default: the instance's, else {default_url or 'none'}].",
            ),
        ]
        profile = click.option("--profile", "profile_name", default=None, help=profile_help)
        options = [*naming, profile, root_option] if named else [profile]
        for option in reversed([*options, api_key_options]):
            wrapper = option(wrapper)
        return wrapper

    return decorate


@contextlib.contextmanager
def progress_bar(total: int, label: str):
    """A progress bar on stderr (click hides it when stderr is not a terminal); yields its
    ``update``, or ``None`` for fewer than two steps."""
    if total < 2:
        yield None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


def gate_options(f):
    """The cutover's gate options beyond --timeout, one spelling for an instance and a group:
    --canary/--no-canary, --canary-timeout, --canary-file, --allow-unit-overrides."""
    from .. import canary as canaries

    for option in reversed(
        [
            click.option(
                "--canary/--no-canary",
                default=None,
                help="Run the output canary: record the old image's answers before the restart "
                "and compare the new image's after the other gates [default: the profile's "
                "[canary] enabled].",
            ),
            click.option(
                "--canary-timeout",
                type=SECONDS,
                default=canaries.DEFAULT_TIMEOUT,
                show_default=True,
                help="Seconds the canary may take on each side (the old image's answers before "
                "the restart, the new image's after the gates), on top of --timeout; slower "
                "fails the canary.",
            ),
            click.option(
                "--canary-file",
                multiple=True,
                type=click.Path(path_type=Path, dir_okay=False),
                help="Your JSONL canary cases, added to the shipped set (repeatable).",
            ),
            click.option(
                "--allow-unit-overrides",
                is_flag=True,
                help="Go ahead although a drop-in or a second EnvironmentFile may set "
                "VLLM_IMAGE for the unit (the gates still check the image the container runs).",
            ),
        ]
    ):
        f = option(f)
    return f
