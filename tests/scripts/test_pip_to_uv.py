"""scripts/pip_to_uv.py: pip's configured package sources become the same sources for uv."""

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.pip_to_uv import parse_config, uv_options

ROOT = Path(__file__).resolve().parents[2]

LISTED = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/other.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/elsewhere'
"""


@pytest.mark.claim("install-uv-or-pip")
def test_every_source_pip_reads_is_an_option_and_the_environment_wins_over_files():
    assert uv_options(parse_config(LISTED)) == [
        "--index-strategy",
        "unsafe-best-match",  # pip's choice: the best version over all indexes
        "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",  # PIP_CERT over global.cert
        "--constraint",
        "/etc/xdg/pip/constraints.txt",
        "UV_HTTP_TIMEOUT=180",
        "--extra-index-url",
        "file:///opt/pypi/simple",
        "--extra-index-url",
        "file:///opt/pypi-more/simple",
        "--find-links",
        "/opt/wheels",
    ]


def test_index_no_index_and_trusted_hosts():
    settings = parse_config(
        "global.index-url='https://mirror.example/simple'\nglobal.no-index='true'\n"
        "global.trusted-host='mirror.example other.example'\n"
    )
    assert uv_options(settings)[2:] == [
        "--index-url",
        "https://mirror.example/simple",
        "--no-index",
        "--allow-insecure-host",
        "mirror.example",
        "--allow-insecure-host",
        "other.example",
    ]


@pytest.mark.claim("install-uv-or-pip")
def test_a_setting_uv_cannot_follow_is_named_and_pip_installs_instead():
    with pytest.raises(ValueError, match="use-feature='truststore' has no uv equivalent"):
        uv_options(parse_config("global.use-feature='truststore'\n"))
    done = subprocess.run(
        [sys.executable, "scripts/pip_to_uv.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PIP_USE_FEATURE": "truststore", "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert done.returncode == 3 and "use-feature" in done.stderr, done.stderr
