"""Flags and their ``BROKER_*`` variables, built from the settings tables.

One mechanism for every option of the three commands: a flag ``--some-thing`` reads its
default from ``BROKER_SOME_THING`` and names it in ``--help``; a switch is on when its
variable is ``1``, ``true``, ``yes`` or ``on``; a repeatable flag and its variable each
take a comma-separated list. A row of a settings table (:mod:`broker.model.setting`) becomes such
a flag with its default, help and rule, so argparse only turns text into a value and the
table's rule judges it, in the wording a bad constructor argument gets
(:mod:`broker.model.checks`). A bad variable is reported by its own name (exit 2) unless
the flag itself is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from broker.exceptions import ConfigurationError
from broker.model import checks, logs
from broker.model.setting import Setting, default_of, flag_of, rows, seconds
from broker.wire import messages as protocol
from broker.wire.addresses import parse_addresses
from broker.wire.credentials import Credentials, check_private_file, parse_token_file
from broker.wire.tls import PeerTLS, ServerTLS

_S = TypeVar("_S")


@dataclasses.dataclass(frozen=True)
class _BadEnvironment:
    """An option's default from a ``BROKER_*`` variable that does not parse; reported by
    :func:`parse` with the variable's name (only if the flag itself is not given)."""

    variable: str
    text: str
    problem: str


def env_name(flag: str) -> str:
    """``--some-thing`` reads ``BROKER_SOME_THING``."""
    return "BROKER_" + flag.removeprefix("--").replace("-", "_").upper()


class _EnvDefault(argparse.Action):
    """Takes its default from an environment variable and says so in ``--help``."""

    def __init__(self, envvar: str, required: bool = False, default: Any = None, **kw: Any):
        if envvar in os.environ:
            default = _from_environment(envvar, os.environ[envvar], kw.get("type"))
        if required and default is not None:
            required = False
        kw["help"] = f"{kw.get('help', '')} [env {envvar}]".strip()
        super().__init__(default=default, required=required, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


def _comma_items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


class _EnvList(argparse.Action):
    """A repeatable flag whose default is its variable, comma-separated; each flag's value
    is split on commas the same way (``--app a,b`` is ``--app a --app b``, as
    ``BROKER_APP=a,b`` is). The flags, once given, replace the variable's list rather than
    add to it."""

    def __init__(self, envvar: str, default: Any = None, **kw: Any):
        items = _comma_items(os.environ.get(envvar, ""))
        kw["help"] = f"{kw.get('help', '')} [env {envvar}, comma-separated]".strip()
        super().__init__(default=items or default, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, [*items, *_comma_items(values)])


def _from_environment(variable: str, text: str, kind: Callable[[str], Any] | None) -> Any:
    """The variable's value, converted now, so a bad one is reported by its own name
    rather than as the flag it stands in for."""
    if kind is None:
        return text
    try:
        return kind(text)
    except argparse.ArgumentTypeError as exc:  # every type here says what it expected
        return _BadEnvironment(variable, text, str(exc))


def parse(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    checks: Sequence[Callable[[argparse.Namespace], object]] = (),
) -> argparse.Namespace:
    """``parser.parse_args``, with a bad ``BROKER_*`` variable named as such, and each of
    ``checks`` (a rule between flags that raises :class:`ConfigurationError`) a usage error
    too: exit 2, before anything is opened."""
    args = parser.parse_args(argv)
    for value in vars(args).values():
        if isinstance(value, _BadEnvironment):
            parser.error(
                f"environment variable {value.variable}={value.text!r} is not valid: "
                f"{value.problem}"
            )
    for check in checks:
        try:
            check(args)
        except ConfigurationError as exc:
            parser.error(str(exc))
    return args


def env_option(parser: argparse.ArgumentParser, flag: str, **options: Any) -> None:
    """An option whose default comes from ``BROKER_<FLAG>`` (named in ``--help``)."""
    parser.add_argument(flag, action=_EnvDefault, envvar=env_name(flag), **options)


def env_switch(parser: argparse.ArgumentParser, flag: str, *, help: str) -> None:
    """An on/off flag, on by default when its variable says so."""
    envvar = env_name(flag)
    on = os.environ.get(envvar, "").strip().lower() in {"1", "true", "yes", "on"}
    parser.add_argument(flag, action="store_true", default=on, help=f"{help} [env {envvar}]")


def env_list(parser: argparse.ArgumentParser, flag: str, **options: Any) -> None:
    """A repeatable flag, or its variable, each a comma-separated list."""
    parser.add_argument(flag, action=_EnvList, envvar=env_name(flag), **options)


def typed(
    kind: Callable[[str], _S], rule: Callable[[str, Any], object] | None, name: str
) -> Callable[[str], _S]:
    """An argparse ``type``: ``kind`` of the text, judged by ``rule`` (from
    :mod:`broker.model.checks`), refused in ``rule``'s words."""

    def convert(text: str) -> _S:
        try:
            value = kind(text)
            if rule is not None and value is not None:  # None: "none" (an age of 0)
                rule(name, value)
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        except (TypeError, ValueError):
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(str(checks.refuse(name, what, text))) from None
        return value

    convert.__name__ = name
    return convert


def duration(text: str) -> float:
    """Seconds, as ``90``, ``30s``, ``15m``, ``12h`` or ``7d`` (an argparse ``type``)."""
    return typed(seconds, None, "duration")(text)


def count(name: str) -> Callable[[str], int]:
    """A whole number of at least zero (an argparse ``type``)."""
    return typed(int, checks.non_negative_int, name)


def positive(kind: Callable[[str], _S], name: str) -> Callable[[str], _S]:
    """A number above zero (an argparse ``type``)."""
    return typed(kind, checks.positive, name)


def add_rows(parser: argparse.ArgumentParser, table: type) -> None:
    """A flag for each row of ``table`` that has help (the others have no flag)."""
    for field, row in rows(table):
        if row.help is None:
            continue
        flag = flag_of(field, row)
        if row.parse is bool:
            env_switch(parser, flag, help=row.help)
            continue
        default = None if row.derived else default_of(field)
        extra = {} if row.metavar is None else {"metavar": row.metavar}
        env_option(
            parser,
            flag,
            default=default,
            type=_row_type(field.name, row),
            help=row.help,
            **extra,
        )


def _row_type(name: str, row: Setting) -> Callable[[str], Any] | None:
    if row.parse is str and row.check is None:
        return None
    return typed(row.parse, row.check, name)


def _dest(field: dataclasses.Field[Any], row: Setting) -> str:
    return flag_of(field, row).removeprefix("--").replace("-", "_")


def from_args(table: type[_S], args: argparse.Namespace, **given: Any) -> _S:
    """The settings ``table`` made from the flags of its rows, and ``given`` (the fields
    that have no flag, or one whose value is derived)."""
    values = {
        field.name: getattr(args, _dest(field, row))
        for field, row in rows(table)
        if row.help is not None
    }
    return table(**{**values, **given})


# ------------------------------------------------------------------------ version

DISTRIBUTION = "broker-jobs"


def version() -> str:
    """The installed distribution's version; a checkout run without installing it (``python
    -m broker.cli`` from the source tree) has none to report, and says so. Imported here:
    the metadata machinery (email parsing) costs every command's start, ``--version`` alone
    needs it."""
    import importlib.metadata

    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return f"(unknown: the {DISTRIBUTION} distribution is not installed)"


class _Version(argparse.Action):
    """argparse's ``version`` action, with the version looked up when ``--version`` is
    given rather than when the parser is built (every start of every command)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog} {version()}")
        parser.exit()


def add_version(p: argparse.ArgumentParser) -> None:
    """``--version``: the program's name and the distribution's version, then exit 0."""
    p.add_argument(
        "--version", action=_Version, help="print the program's name and version and exit"
    )


# ------------------------------------------------------------------------ logs


def add_log_options(p: argparse.ArgumentParser, *, level: bool = True) -> None:
    if level:
        env_option(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    env_option(
        p,
        "--log-format",
        default="text",
        type=_log_format,
        help="text (one line per event, tracebacks indented) or json (one object per line)",
    )


def _log_format(text: str) -> str:
    if text not in logs.FORMATS:
        raise argparse.ArgumentTypeError(f"expected {' or '.join(logs.FORMATS)} (got {text!r})")
    return text


# ------------------------------------------------------------------------ credentials, TLS


def add_credential_options(
    p: argparse.ArgumentParser, roles: Sequence[protocol.Role], text: str
) -> None:
    """``--token`` (every role's), ``--<role>-token`` for each of ``roles`` and
    ``--token-file``; each also from its ``BROKER_*`` variable, so no secret ever needs
    to be on a command line (where ``ps`` shows it)."""
    env_option(p, "--token", help="the shared secret, for every role without its own")
    for role in roles:
        env_option(p, f"--{role}-token", help=text.format(role=role))
    env_option(
        p,
        "--token-file",
        metavar="PATH",
        help="a file of role=secret lines (worker, client, operator, or all)",
    )


def credentials(args: argparse.Namespace) -> Credentials:
    """The secrets from the flags, their variables and the token file (see
    :meth:`broker.wire.credentials.Credentials.combine` for which wins)."""
    lines: dict[str, str] | None = None
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as file:
                check_private_file(
                    os.fstat(file.fileno()).st_mode, f"--token-file {args.token_file}"
                )
                text = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"cannot read --token-file {args.token_file}: {exc}") from None
        lines = parse_token_file(text, f"--token-file {args.token_file}")
    return Credentials.combine(
        shared=args.token or None,
        worker=getattr(args, "worker_token", None) or None,
        client=getattr(args, "client_token", None) or None,
        operator=getattr(args, "operator_token", None) or None,
        file=lines,
    )


def add_peer_tls_options(p: argparse.ArgumentParser) -> None:
    env_option(
        p,
        "--tls-ca",
        metavar="PEM",
        help="connect over TLS, trusting this CA for the main's certificate (its host name "
        "is checked too)",
    )
    env_switch(p, "--tls", help="connect over TLS, trusting the system's CAs (implied by --tls-ca)")
    env_option(p, "--tls-client-cert", metavar="PEM", help="mutual TLS: this peer's certificate")
    env_option(p, "--tls-client-key", metavar="PEM", help="the private key of --tls-client-cert")


def peer_tls(args: argparse.Namespace) -> PeerTLS | None:
    if not (args.tls or args.tls_ca or args.tls_client_cert or args.tls_client_key):
        return None
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise ConfigurationError("--tls-client-cert and --tls-client-key go together")
    return PeerTLS(
        ca=args.tls_ca or None,
        client_cert=args.tls_client_cert or None,
        client_key=args.tls_client_key or None,
    )


def add_server_tls_options(p: argparse.ArgumentParser) -> None:
    env_option(p, "--tls-cert", metavar="PEM", help="serve TLS with this certificate (chain)")
    env_option(p, "--tls-key", metavar="PEM", help="the private key of --tls-cert")
    env_option(
        p,
        "--tls-client-ca",
        metavar="PEM",
        help="mutual TLS: refuse every peer without a client certificate this CA signed",
    )


def server_tls(args: argparse.Namespace) -> ServerTLS | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise ConfigurationError(
            "--tls-cert and --tls-key go together (--tls-client-ca needs both as well)"
        )
    return ServerTLS(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca or None)


def add_main_address(p: argparse.ArgumentParser) -> None:
    env_option(
        p,
        "--main",
        default=f"127.0.0.1:{protocol.DEFAULT_PORT}",
        help="the main's HOST:PORT, or every main's, comma-separated (HOST:PORT,HOST:PORT): "
        "a standby names the elected one, and a lost connection tries the next",
    )


def check_main_address(parser: argparse.ArgumentParser, text: str) -> None:
    """``--main`` is checked before anything connects: a bad one is a usage error."""
    try:
        parse_addresses(text)
    except ConfigurationError as exc:
        parser.error(f"--main: {exc}")
