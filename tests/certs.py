"""Test certificates, made with trustme: a CA, a producer's, clients' good and bad."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import trustme

from streamq import ClientTLS, ServerTLS

PAST = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)


@dataclass(frozen=True)
class Certs:
    """PEM files: a CA, the producer's certificate, client certificates good and bad."""

    ca: str
    other_ca: str
    server: ServerTLS
    expired_server: ServerTLS
    client: ClientTLS
    client_of_other_ca: ClientTLS
    expired_client: ClientTLS


def _write(cert: trustme.LeafCert, folder: Path, name: str) -> tuple[str, str]:
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    return str(cert_path), str(key_path)


def _expired(ca: trustme.CA, name: str) -> trustme.LeafCert:
    return ca.issue_cert(name, not_before=PAST, not_after=PAST + datetime.timedelta(days=1))


def make_certs(folder: Path) -> Certs:
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    other.cert_pem.write_to_path(str(folder / "other-ca.pem"))
    server = _write(ca.issue_cert("127.0.0.1", "::1", "localhost"), folder, "server")
    old_server = _write(_expired(ca, "127.0.0.1"), folder, "old-server")
    client = _write(ca.issue_cert("billing@example"), folder, "client")
    stranger = _write(other.issue_cert("billing@example"), folder, "stranger")
    old_client = _write(_expired(ca, "billing@example"), folder, "old-client")
    ca_path = str(folder / "ca.pem")
    return Certs(
        ca=ca_path,
        other_ca=str(folder / "other-ca.pem"),
        server=ServerTLS(*server, client_ca=ca_path),
        expired_server=ServerTLS(*old_server),
        client=ClientTLS(ca_path, *client),
        client_of_other_ca=ClientTLS(ca_path, *stranger),
        expired_client=ClientTLS(ca_path, *old_client),
    )
