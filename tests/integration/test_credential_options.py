"""The commands' credential and TLS options: a bad token file or half a TLS pair is a
clear error before anything listens, and the operator's command picks its role from the
secrets it was given."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.ops import cli
from broker.wire.credentials import Credentials
from broker.wire.messages import Role


def _main(tmp_path: Path, *extra: str) -> list[str]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}"
    return ["--database-url", url, "--port", "0", *extra]


def test_a_bad_token_file_line_is_named_by_number_and_not_echoed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secrets = tmp_path / "secrets"
    secrets.write_text("worker=w\nadmin=hunter2\n")
    secrets.chmod(0o600)
    assert cli.main_entry(_main(tmp_path, "--token-file", str(secrets))) == 1
    err = capsys.readouterr().err
    assert f"--token-file {secrets} line 2: expected role=secret" in err
    assert "hunter2" not in err
    assert not (tmp_path / "broker.db").exists(), "refused before the store was opened"


def test_half_a_tls_pair_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main_entry(_main(tmp_path, "--tls-cert", str(tmp_path / "main.pem")))
    assert stopped.value.code == 2, "a usage error"
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err


def test_a_missing_certificate_file_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = ["--tls-cert", str(tmp_path / "no.pem"), "--tls-key", str(tmp_path / "no.key")]
    assert cli.main_entry(_main(tmp_path, *missing)) == 1
    assert "cannot load --tls-cert/--tls-key" in capsys.readouterr().err
    assert not (tmp_path / "broker.db").exists(), "refused before the store was opened"


@pytest.mark.parametrize(
    ("credentials", "role", "secret"),
    [
        (Credentials(worker="w", client="c", operator="o"), Role.OPERATOR, "o"),
        (Credentials(operator="o"), Role.OPERATOR, "o"),
        (Credentials(client="c"), Role.CLIENT, "c"),
        # One shared token: a client hello, which has every right (and old mains know it).
        (Credentials.combine(shared="s"), Role.CLIENT, "s"),
        (Credentials(), Role.CLIENT, None),
    ],
)
def test_the_operator_command_says_hello_as_the_role_its_secrets_allow(
    credentials: Credentials, role: Role, secret: str | None
) -> None:
    assert cli.operator_credential(credentials) == (role, secret)
