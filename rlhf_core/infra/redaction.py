"""Redaction: what leaves a process for a record (MLflow, stage.json, Prefect, job logs) carries no secret.

One set of rules at every boundary where text becomes a record:
- values of fields whose name's last word says secret (`hf_token`, `api_key`, `password`), so
  `input_key` or `max_new_tokens` keep theirs;
- credentials inside text: URL userinfo, token-like query parameters (`?token=`,
  `X-Amz-Signature=`), well-known token shapes (`hf_...`, `sk-...`, `ghp_...`, `AKIA...`);
- the value of every credential environment variable of the process, wherever it appears.

`inline_secrets` finds the same in parameters before they are stored, so the orchestration layer
can refuse them: Prefect stores a flow run's parameters before any of our code runs.
"""

from __future__ import annotations

import os
import re

REDACTED = "***"
# Not "pwd" (PWD is the working directory) nor "auth" (a switch or a mode far more often than a secret).
SECRET_WORDS = {"token", "secret", "password", "passwd", "credential", "credentials", "apikey"}
SECRET_SUFFIXES = ("api_key", "access_key", "secret_key", "private_key", "access_key_id", "session_token",
                   "auth_token", "secret_access_key", "wandb_key")
# Query parameters that carry a credential whatever their name's last word (AWS/GCS/Azure signed URLs).
SECRET_QUERY_NAMES = {"sig", "signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token",
                      "x-goog-signature", "x-goog-credential", "key", "access_token", "refresh_token"}
TOKEN_SHAPES = re.compile(r"\b(hf_[A-Za-z0-9]{8,}|sk-[A-Za-z0-9_-]{8,}|gh[pousr]_[A-Za-z0-9]{8,}|AKIA[0-9A-Z]{12,}"
                          r"|xox[baprs]-[A-Za-z0-9-]{8,})")
URI_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?P<userinfo>[^/@\s?#]+)@", re.I)
QUERY_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[A-Za-z0-9_.-]+)=(?P<value>[^&#\s'\"]+)")
# A credential environment variable's value shorter than this is not searched for in text: a
# 3-letter password would redact every word it happens to be part of.
MIN_ENV_SECRET_LEN = 6


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


# A "token" of the vocabulary, not a credential: `placeholder_token` (a PRM's step mark), `pad_token`.
VOCABULARY_TOKENS = {"placeholder", "pad", "bos", "eos", "unk", "sep", "cls", "mask"}


def is_secret_key(name: str) -> bool:
    """True for a field or variable name that holds a credential: its last word or its suffix says so
    (a vocabulary token's name, `placeholder_token`, does not)."""
    words = _words(name)
    if not words:
        return False
    if words[-1] == "token" and len(words) > 1 and words[-2] in VOCABULARY_TOKENS:
        return False
    return words[-1] in SECRET_WORDS or "_".join(words).endswith(SECRET_SUFFIXES)


def _secret_query_name(name: str) -> bool:
    return name.lower() in SECRET_QUERY_NAMES or is_secret_key(name)


def secret_env_values(environ=None) -> list[str]:
    """Values of the credential environment variables, longest first (so no value is cut by a shorter one).

    A value that is an absolute path names where a credential is (GOOGLE_APPLICATION_CREDENTIALS), not
    the credential: replacing it would rewrite every output path under it in the records.
    """
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if is_secret_key(k) and len(v) >= MIN_ENV_SECRET_LEN
              and not os.path.isabs(v)}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, environ=None) -> str:
    """`text` with every credential the rules know replaced by `***`."""
    if not text:
        return text
    for value in secret_env_values(environ):
        if value in text:
            text = text.replace(value, REDACTED)
    text = URI_USERINFO.sub(lambda m: m["scheme"] + REDACTED + "@", text)
    text = QUERY_PARAM.sub(lambda m: f"{m['sep']}{m['name']}={REDACTED}" if _secret_query_name(m["name"])
                           else m[0], text)
    return TOKEN_SHAPES.sub(REDACTED, text)


def redact(values, environ=None):
    """The same nested structure with secret-named fields and every credential inside text replaced."""
    if isinstance(values, dict):
        return {k: REDACTED if is_secret_key(str(k)) and v not in (None, "") else redact(v, environ)
                for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return [redact(v, environ) for v in values]
    if isinstance(values, str):
        return redact_text(values, environ)
    return values


def inline_secrets(values, path: str = "") -> list[str]:
    """Dotted paths of the values in `values` (nested dicts/lists of params) that carry a secret inline.

    Env-variable values count too: a parameter that repeats one is a copy of the secret.
    """
    found: list[str] = []
    if isinstance(values, dict):
        for k, v in values.items():
            name = f"{path}.{k}" if path else str(k)
            if is_secret_key(str(k)) and v not in (None, "", False):
                found.append(name)
            else:
                found += inline_secrets(v, name)
    elif isinstance(values, (list, tuple)):
        for i, v in enumerate(values):
            found += inline_secrets(v, f"{path}[{i}]")
    elif isinstance(values, str) and redact_text(values) != values:
        found.append(path or "<value>")
    return found


def refuse_inline_secrets(params: dict, where: str) -> None:
    """ConfigError naming every parameter of `params` that carries a credential inline.

    For parameters that are stored as given before any of our code runs (a Prefect flow run's),
    where redaction comes too late.
    """
    from rlhf_core.infra.settings import ConfigError

    found = inline_secrets(params)
    if found:
        raise ConfigError(f"{where}: {', '.join(found)} carries a credential inline, and flow-run parameters are "
                          "stored as given; put it in an environment variable of the workers (AWS_SECRET_ACCESS_KEY, "
                          "RLHF_RM_TOKEN, ...) or a Prefect Secret block, and leave it out of the parameters")
