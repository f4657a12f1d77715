"""The args file: the engine and container arguments ``appliance instance install`` derives from the
profile, read by the serve program at every start (``/etc/gemma4-vllm/<instance>.args``, JSON).

It holds arguments only, never code: each string is one argument as is. A file of another
format is refused with the install command that rewrites it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UsageError
from ..host.values import REQUIRABLE_KEYS

FORMAT = 2
ROLES = ("target", "drafter")
LAYOUTS = ("hub", "dir")  # the Hugging Face cache in HF_CACHE_DIR, or a directory in MODEL_DIR
# A hub repo id, a revision or a directory in MODEL_DIR: each path component starts with a
# letter or digit (no "..", no leading "-"), so a name can never leave its directory.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # no line breaks, no terminal escapes
_LISTS = ("serve", "mtp", "per_request", "queue", "docker", "require")


class ArgsFileError(UsageError):
    """The args file cannot be read or is not what ``appliance instance install`` writes."""


@dataclass(frozen=True)
class ModelRecord:
    """One model the engine loads, checked present and complete before every start."""

    role: str
    layout: str
    name: str
    revision: str | None = None

    def __post_init__(self) -> None:
        bad = (
            self.role not in ROLES
            or self.layout not in LAYOUTS
            or not isinstance(self.name, str)
            or not MODEL_NAME.fullmatch(self.name)
            or (self.revision is not None and self.layout == "dir")
            or (self.revision is not None and not MODEL_NAME.fullmatch(str(self.revision)))
        )
        if bad:
            raise UsageError(f"bad model record {self.text()!r}")

    def text(self) -> str:
        """The record in one line (``ROLE LAYOUT NAME [REVISION]``), for messages."""
        return " ".join(str(v) for v in (self.role, self.layout, self.name, self.revision) if v)


@dataclass(frozen=True)
class ServeArgs:
    """What one instance serves, from its profile: ``serve`` after ``vllm serve`` (the serve
    program adds ``--host``/``--port``), ``mtp`` only for an image labelled MTP, ``per_request``
    too when its vLLM has per-request metrics, ``queue`` (the queue bound) when its vLLM has the
    flag, ``docker`` options, the env keys the instance must set (``require``) and its
    ``models``."""

    profile: str
    serve: tuple[str, ...]
    mtp: tuple[str, ...] = ()
    per_request: tuple[str, ...] = ()
    queue: tuple[str, ...] = ()
    docker: tuple[str, ...] = ()
    require: tuple[str, ...] = ()
    models: tuple[ModelRecord, ...] = ()

    def to_json(self, about: str) -> str:
        """The file's text; ``about`` says what it is to a reader (JSON has no comments)."""
        fields = {k: v for k, v in asdict(self).items() if k != "format"}
        if not self.queue:
            # Left out when empty: a serve program older than the queue bound reads the file.
            del fields["queue"]
        body = {"format": FORMAT, "about": about, **fields}
        return json.dumps(body, indent=2) + "\n"

    def rendezvous(self) -> tuple[str, int] | None:
        """A headless worker's head: ``--master-addr`` and ``--master-port``; None for any other
        node or instance."""
        if "--headless" not in self.serve:
            return None
        flags = dict(zip(self.serve, self.serve[1:]))
        try:
            return flags["--master-addr"], int(flags["--master-port"])
        except (KeyError, ValueError):
            return None

    def served_model_name(self) -> str | None:
        """The ``--served-model-name`` the engine answers to, if the arguments set one."""
        for flag, value in zip(self.serve, self.serve[1:]):
            if flag == "--served-model-name":
                return value
        return None


def check_argument(value: object, where: str) -> str:
    """``value`` if it can be one argument: a string, one line, no control characters, not
    empty, no surrounding whitespace."""
    if not isinstance(value, str) or not value or CONTROL.search(value) or value != value.strip():
        raise UsageError(
            f"{where} {value!r} cannot be passed as one argument",
            fix="use a non-empty value on one line without control characters or "
            "surrounding spaces",
        )
    return value


def parse(text: str, where: str) -> ServeArgs:
    """The record in ``text`` (the content of ``where``); an ArgsFileError naming the field."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ArgsFileError(f"{where} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ArgsFileError(f"{where}: expected a JSON object")
    if data.get("format") != FORMAT:
        raise ArgsFileError(
            f"{where} has format {data.get('format')!r}, this serve program reads {FORMAT}"
        )
    known = {"format", "about", "profile", "models", *_LISTS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ArgsFileError(f"{where}: unknown field(s) {', '.join(unknown)}")
    lists = {}
    for key in _LISTS:
        value = data.get(key, [])
        if not isinstance(value, list):
            raise ArgsFileError(f"{where}: {key} = {value!r}: expected a list of arguments")
        lists[key] = tuple(_argument(v, f"{where}: {key}[{i}]") for i, v in enumerate(value))
    models = data.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ArgsFileError(f"{where}: models = {models!r}: expected a list of objects")
    records = tuple(_model(where, **m) for m in models)
    return _checked(data.get("profile"), lists, records, where)


def _argument(value: object, where: str) -> str:
    try:
        return check_argument(value, where)
    except UsageError as exc:
        raise ArgsFileError(exc.message) from None


def _model(where: str, *args: object, **kwargs: object) -> ModelRecord:
    try:
        return ModelRecord(*args, **kwargs)
    except TypeError:
        raise ArgsFileError(f"{where}: bad model record {args or kwargs!r}") from None
    except UsageError as exc:
        raise ArgsFileError(f"{where}: {exc.message}") from None


def _checked(profile, lists, models, where: str) -> ServeArgs:
    if not isinstance(profile, str) or not profile or not lists["serve"]:
        raise ArgsFileError(f"{where} names no profile or no arguments")
    for key in lists["require"]:
        # The name is looked up in the environment: a file may only name one of these.
        if key not in REQUIRABLE_KEYS:
            raise ArgsFileError(f"{where} requires {key!r}, which the serve program does not know")
    return ServeArgs(profile=profile, models=models, **lists)


def read(path: Path) -> ServeArgs:
    """The args file at ``path``; an ArgsFileError when it is missing or malformed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ArgsFileError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}")
    return parse(text, str(path))
