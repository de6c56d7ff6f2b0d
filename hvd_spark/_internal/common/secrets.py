"""Which storage options are credentials, so that they are never saved, shown or logged.

Pure functions on plain data (no Spark, no fsspec). A store's ``storage_options`` are fsspec
keyword arguments: some say where and how to connect (``endpoint_url``, ``region_name``,
``use_ssl``, ``profile``...), others are credentials (``key``, ``secret``, ``token``, ``password``,
``client_kwargs={"aws_secret_access_key": ...}``...). :func:`split_secrets` keeps the first kind and
names what it left out; a loaded estimator or transformer gets the credentials back from the
environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, which s3fs reads), a profile, or the
options given again.
"""

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"

# Words that make an option name a credential, wherever they appear in it (``key``, ``aws_secret_access_key``,
# ``session_token``, ``SAS_TOKEN``, ``clientSecret``, ``Authorization`` ...). Not ``signature``:
# ``config_kwargs={"signature_version": "s3v4"}`` is a setting.
_SECRET_WORDS = frozenset(
    {
        "key",
        "keys",
        "apikey",
        "pkey",
        "secret",
        "secrets",
        "token",
        "tokens",
        "password",
        "passwd",
        "passphrase",
        "pwd",
        "credential",
        "credentials",
        "creds",
        "auth",
        "authorization",
        "cookie",
        "cookies",
        "sas",
        "private",
    }
)
# Whole names that hold credentials without one of those words.
_SECRET_NAMES = frozenset({"connection_string", "connectionstring", "conn_str", "sig"})
# Options that name a place though a word above is in them. (``key_filename``, a path to a key file,
# is left out like a key: it says where a credential is.)
_PUBLIC_NAMES = frozenset({"token_endpoint", "token_url", "auth_url", "oauth_url"})


def _words(name: str) -> list[str]:
    """``aws_secret_access_key`` -> [aws, secret, access, key]; ``clientSecret`` -> [client, secret]."""
    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", name)  # SSEKMSKeyId -> SSEKMS KeyId
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", spaced)
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_name(name: Any) -> bool:
    """Whether an option called ``name`` holds a credential (by its name alone)."""
    if not isinstance(name, str):
        return False
    low = name.lower()
    if low in _PUBLIC_NAMES:
        return False
    if low in _SECRET_NAMES:
        return True
    return any(w in _SECRET_WORDS for w in _words(name))


def _url_with_credentials(value: Any) -> bool:
    """Whether ``value`` is a URL with a user and password in it (``http://user:pw@host``)."""
    if not isinstance(value, str) or "://" not in value or "@" not in value:
        return False
    try:
        return urlsplit(value).password is not None
    except ValueError:
        return False


def split_secrets(options: Mapping | None) -> tuple[dict, list[str]]:
    """A copy of ``options`` without its credentials, and the names of what was left out.

    Nested dicts (``client_kwargs``, ``config_kwargs``, ``headers``) are searched too: their
    removed entries are named with dots (``client_kwargs.aws_secret_access_key``). A value that
    is a URL with a password in it goes as well. Lists and tuples are searched for dicts."""
    removed: list[str] = []

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, Mapping):
            kept = {}
            for k, v in value.items():
                name = f"{where}.{k}" if where else str(k)
                if is_secret_name(k) or _url_with_credentials(v):
                    removed.append(name)
                    continue
                kept[k] = walk(v, name)
            return kept
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, f"{where}[{i}]") for i, v in enumerate(value))
        return value

    public = walk(dict(options or {}), "")
    return public, removed


def redacted(options: Mapping | None) -> dict:
    """A copy of ``options`` for display: every credential's value replaced by ``***``."""

    def walk(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: REDACTED if is_secret_name(k) or _url_with_credentials(v) else walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    return walk(dict(options or {}))


def url_without_credentials(url: str) -> str:
    """``url`` without a user and password in its address (``s3://k:s@bucket/p`` -> ``s3://bucket/p``);
    other strings as they are."""
    if not isinstance(url, str) or "://" not in url or "@" not in url:
        return url
    try:
        parts = urlsplit(url)
        if parts.username is None and parts.password is None:
            return url
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    except ValueError:
        return url
