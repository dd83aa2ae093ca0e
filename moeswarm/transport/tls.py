"""The swarm key: mutual TLS 1.3 between a backbone and its workers, pinned to one shared certificate.

`moeswarm keygen -o swarm.key` writes a PEM file holding a private key and a self-signed
certificate for it. Every member of a swarm (workers, backbones) is given the same file: each side
presents that certificate and trusts no other, so a peer without the file fails the TLS handshake
and receives nothing of the moeswarm protocol, not even an ERROR frame; and nobody on the path
can read or alter the hidden states. Host names are not checked: the pinned certificate is the
identity, as in a pre-shared key.
"""

from __future__ import annotations

import datetime
import os
import ssl
from pathlib import Path

from moeswarm.errors import MoeSwarmError

SUBJECT = "moeswarm swarm"
VALID_DAYS = 3650


def write_swarm_key(path: str | os.PathLike) -> Path:
    """A new key and its self-signed certificate in one PEM file, readable by its owner only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    path = Path(path)
    if path.exists():
        raise MoeSwarmError(f"{path} already exists: choose another -o, or remove it first")
    if not path.parent.is_dir():
        raise MoeSwarmError(f"cannot write {path}: no directory {path.parent}")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SUBJECT)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pem += certificate.public_bytes(serialization.Encoding.PEM)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(pem)
    return path


def server_context(key_file: str | os.PathLike) -> ssl.SSLContext:
    """A worker's side: present the swarm certificate, require the same from the peer."""
    return _context(ssl.PROTOCOL_TLS_SERVER, key_file)


def client_context(key_file: str | os.PathLike) -> ssl.SSLContext:
    """A backbone's side: present the swarm certificate, accept only a peer holding the same."""
    return _context(ssl.PROTOCOL_TLS_CLIENT, key_file)


def _context(protocol: int, key_file: str | os.PathLike) -> ssl.SSLContext:
    key_file = Path(key_file)
    if not key_file.is_file():
        raise MoeSwarmError(f"swarm key {key_file} not found: make one with `moeswarm keygen -o {key_file}`")
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # the pinned certificate is the identity, not a host name
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(key_file)
        context.load_verify_locations(key_file)
    except (ssl.SSLError, ValueError) as error:
        raise MoeSwarmError(f"swarm key {key_file} is not a key and certificate made by `moeswarm keygen` ({error})") from None
    return context
