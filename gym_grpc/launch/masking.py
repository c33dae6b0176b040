"""What `gym-grpc dump-config` and the dataset stores keep out of sight: secrets, by their name or
their shape.

A setting or variable named like a key, token, secret, password, credentials or auth is a secret,
and so is its value wherever it appears (inside a URL or a header too); whatever their name,
values shaped like secrets are too: a URL's password, keys with a well-known prefix, long words of
letters and digits.
"""

from __future__ import annotations

import re
from typing import Any

#: Names of settings and variables (env.yaml keys, `${NAME}` environment variables) whose values
#: are secrets: api_key, token, hf_token, OPENAI_API_KEY, DB_PASSWORD, proxy_credentials, ...
_SECRET_NAME = re.compile(r"(^|_)(key|token|secret|password|passwd|credentials?|auth)$", re.I)
#: Values that are secrets by their shape, whatever holds them: the password of a URL
#: (scheme://user:PASSWORD@host), a key with a well-known prefix (OpenAI's sk-, Hugging Face's
#: hf_, GitHub's, GitLab's, Slack's, AWS's, a JWT), or a word of 32 or more letters and digits.
_SECRET_SHAPES = (
    re.compile(r"(?<=://)[^:/@\s]*:([^@/\s]+)(?=@)"),
    re.compile(r"\b((?:sk|hf|ghp|gho|ghs|github_pat|glpat|xox[abp]|AKIA|AIza|eyJ)[-_A-Za-z0-9.]{16,})"),
    re.compile(
        r"(?<![-_A-Za-z0-9./])((?=[-_A-Za-z0-9]*\d)(?=[-_A-Za-z0-9]*[A-Za-z])[-_A-Za-z0-9]{32,})(?![-_A-Za-z0-9./])"
    ),
)
MASK = "***"


def secret_text(name: str, value: Any) -> str | None:
    """The text to mask wherever it appears when variable `name` holds a secret.

    None for other variables, and for values shorter than 4 characters (masking
    those everywhere would hide more than the secret)."""
    if not _SECRET_NAME.search(name) or isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    text = str(value)
    return text if len(text) >= 4 else None


def _mask_shapes(text: str) -> str:
    """`text` with every value that looks like a secret (`_SECRET_SHAPES`) masked, whatever its name."""
    for shape in _SECRET_SHAPES:
        text = shape.sub(lambda m: m.group(0).replace(m.group(1), MASK), text)
    return text


def mask(value: Any, secrets: list[str], key: str = "") -> Any:
    """`value` (a configuration's JSON) with its secrets masked: settings named like one (`key` is
    the name of the setting that holds `value`), the texts in `secrets`, values shaped like one."""
    if isinstance(value, dict):
        return {k: mask(v, secrets, k) for k, v in value.items()}
    if isinstance(value, list):
        return [mask(v, secrets, key) for v in value]
    if _SECRET_NAME.search(key) and value not in (None, "") and not isinstance(value, bool):
        return MASK
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, MASK)
        value = _mask_shapes(value)
    return value
