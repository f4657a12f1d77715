"""The hub access token: read from a 0600 file, never from argv, the environment or a log.

Gemma 4 checkpoints are gated: the token of an account that accepted the licence is needed to
download them. The file holds the token alone; a file that others may read is refused (the
token grants that account's access), and no message ever includes its content. The hub client's
own variables (``HF_TOKEN``) are not read for a token; where one is set, the commands say so in
one line (:func:`unused_env`) instead of leaving a user of ``hf`` to wonder.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from ..errors import UsageError
from ..host.names import ENV_DIR

DEFAULT_TOKEN_FILE = f"{ENV_DIR}/hf-token"
_TOKEN = re.compile(r"[A-Za-z0-9_.~+/=-]+")
# huggingface_hub's token variables, in the order it reads them; the appliance uses neither.
HUB_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# Why not: the file is readable by its owner alone, the environment is inherited.
WHY_NOT_ENV = "the environment passes a token to every process a command starts"


def unused_env(env: Mapping[str, str] | None = None) -> str | None:
    """The hub client's token variable set in ``env`` (the process's by default), which the
    appliance does not use; None when none is."""
    env = os.environ if env is None else env
    return next((name for name in HUB_ENV if env.get(name, "").strip()), None)


def read(path: Path, *, required: bool) -> str | None:
    """The token in ``path``; None when it does not exist and was not asked for explicitly."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        if required:
            raise UsageError(
                f"no token file {path}",
                fix="write the token into it and chmod 600 it, or leave out --token-file",
            ) from None
        return None
    except OSError as exc:
        raise UsageError(f"cannot read token file {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"token file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise UsageError(
            f"token file {path} is open to group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); refusing to use it",
            fix=f"chmod 600 {path}",
        )
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        raise UsageError(
            f"token file {path} belongs to another user", fix="run as its owner or root"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read token file {path}") from exc
    token = text.strip()
    if not token:
        raise UsageError(f"token file {path} is empty", fix="write the hub token into it")
    if not _TOKEN.fullmatch(token):
        # Never echo the content: a mangled token is still a secret.
        raise UsageError(
            f"token file {path} holds more than one token-like word",
            fix="keep only the token (hf_...) in the file",
        )
    return token


def scrub(text: str, token: str | None) -> str:
    """``text`` with ``token`` blanked, for any message that might quote a request."""
    return text.replace(token, "***") if token else text
