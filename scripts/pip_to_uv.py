"""pip's configured package sources as ``uv pip install`` options, so both installers read the same ones.

    python scripts/pip_to_uv.py            # reads `python -m pip config list`; one option per line

``scripts/install.sh`` installs the pinned requirements with uv where this succeeds, and with pip
otherwise. uv does not read pip's configuration files or ``PIP_*`` variables, so each setting is
translated here: the index, extra indexes, find-links, constraints, trusted hosts and ``no-index``
become options; the certificate bundle and timeout become ``SSL_CERT_FILE=`` and
``UV_HTTP_TIMEOUT=`` lines (variables for the uv process). ``--index-strategy unsafe-best-match``
makes uv pick, as pip does, the best version across all indexes rather than the first index that
has the package. A setting that changes what gets installed and has no uv equivalent makes this
exit 3 naming it, and the script falls back to pip. Settings that only change pip's output
(``progress-bar``, ``disable-pip-version-check``, ...) are ignored.
"""

from __future__ import annotations

import ast
import subprocess
import sys

EXIT_UNTRANSLATABLE = 3
IGNORED = {
    "disable-pip-version-check",
    "progress-bar",
    "no-color",
    "quiet",
    "verbose",
    "no-input",
    "root-user-action",
    "cache-dir",
    "no-cache-dir",
    "require-virtualenv",
    "break-system-packages",
}
REPEATED = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}


def parse_config(text: str) -> dict[str, str]:
    """``pip config list`` output -> {key: value}; ``PIP_*`` variables (``:env:.``) win over files."""
    settings: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        scope, sep, rest = line.partition(".")
        key, eq, value = rest.partition("=")
        if not sep or not eq:
            continue
        rank = 2 if scope == ":env:" else 1  # pip: environment over configuration files
        if key not in settings or rank >= settings[key][0]:
            settings[key] = (rank, ast.literal_eval(value) if value[:1] in "'\"" else value)
    return {key: value for key, (_, value) in settings.items()}


def uv_options(settings: dict[str, str]) -> list[str]:
    """uv options (and ``NAME=value`` variables) for pip's ``settings``; ValueError naming a
    setting uv cannot honour."""
    out = ["--index-strategy", "unsafe-best-match"]
    for key, value in sorted(settings.items()):
        if key in IGNORED:
            continue
        if key in REPEATED:
            for item in value.split():
                out += [REPEATED[key], item]
        elif key == "index-url":
            out += ["--index-url", value]
        elif key == "no-index":
            if value.lower() in ("1", "true", "yes", "on"):
                out.append("--no-index")
        elif key == "cert":
            out.append(f"SSL_CERT_FILE={value}")
        elif key in ("timeout", "default-timeout"):
            out.append(f"UV_HTTP_TIMEOUT={int(float(value))}")
        else:
            raise ValueError(f"pip setting {key}={value!r} has no uv equivalent here")
    return out


def main() -> int:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if listed.returncode != 0:
        print(f"pip config list failed: {listed.stderr.strip()}", file=sys.stderr)
        return EXIT_UNTRANSLATABLE
    try:
        options = uv_options(parse_config(listed.stdout))
    except ValueError as error:
        print(error, file=sys.stderr)
        return EXIT_UNTRANSLATABLE
    print("\n".join(options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
