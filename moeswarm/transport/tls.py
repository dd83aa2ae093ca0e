"""The swarm key: mutual TLS 1.3 between a backbone and its workers, pinned to one shared certificate.

`moeswarm keygen -o swarm.key` writes a PEM file holding a private key and a self-signed
certificate for it. Every member of a swarm (workers, backbones) is given the same file: each side
presents that certificate and trusts no other, so a peer without the file fails the TLS handshake
and receives nothing of the moeswarm protocol, not even an ERROR frame; and nobody on the path
can read or alter the hidden states. Host names are not checked: the pinned certificate is the
identity, as in a pre-shared key.

A member file (`moeswarm keygen --member`, transport/member_cert.py) works the same way: its
certificate is signed by the swarm key, which both sides trust. Its holder can be revoked: every
handshake also checks the peer's member certificate against the revocation list beside this
process's own key file (FILE.revoked, re-read when it changes), and a revoked peer's handshake
fails (`PeerRefused`, naming the member) before a byte of the moeswarm protocol crosses.
"""

from __future__ import annotations

import datetime
import os
import ssl
from pathlib import Path

from moeswarm.errors import MoeSwarmError
from moeswarm.transport.member_cert import Authority, CertError

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


class PeerRefused(ssl.SSLCertVerificationError):
    """A peer whose certificate TLS accepted but the swarm does not: a revoked member (or any
    member while the revocation list cannot be read). `reason` says which, in one line."""

    def __init__(self, why: str):
        super().__init__(f"peer refused: {why}")
        self.reason = why

    def __str__(self) -> str:
        return self.args[0]  # ssl.SSLError would print the args tuple


class _CheckedSocket(ssl.SSLSocket):
    """A blocking TLS socket (the backbone's links, probes, fetch-slice) that checks its peer."""

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        check_peer(self)


class _CheckedObject(ssl.SSLObject):
    """asyncio's TLS (workers, the seeder) through an SSLObject that checks its peer."""

    def do_handshake(self) -> None:
        super().do_handshake()
        check_peer(self)


class SwarmContext(ssl.SSLContext):
    """An SSLContext whose every connection checks the peer's member certificate after the handshake."""

    sslsocket_class = _CheckedSocket
    sslobject_class = _CheckedObject
    authority: Authority
    member: str | None  # this process's own member certificate ("'NAME' (serial HEX)"); None: the swarm key


def refusal_hint(context: ssl.SSLContext) -> str:
    """Why a worker may close a TLS link before answering HELLO. TLS 1.3 completes the client's
    handshake before the server has checked the client's certificate, so a worker that refuses a
    revoked member can only close the connection: this names the member it may have refused."""
    member = getattr(context, "member", None)
    if member is None:
        return "is it down?"
    return f"is it down, or has this member, {member}, been revoked?"


def check_peer(connection: ssl.SSLSocket | ssl.SSLObject) -> None:
    """PeerRefused unless the peer holds the swarm key itself or a member certificate not revoked.

    TLS has already verified the chain to the swarm's certificate and the dates; this adds what
    OpenSSL cannot know: the swarm's revocation list (transport/member_cert.py)."""
    authority = connection.context.authority
    der = connection.getpeercert(binary_form=True)
    if der is None:  # no certificate at all: CERT_REQUIRED has already failed the handshake
        raise PeerRefused("the peer sent no certificate")
    if der == authority.certificate_der:
        return  # the swarm key's holder: the authority itself, which no list revokes
    try:
        authority.check(der)
    except CertError as error:
        raise PeerRefused(str(error)) from None


def _context(protocol: int, key_file: str | os.PathLike) -> ssl.SSLContext:
    key_file = Path(key_file)
    if not key_file.is_file():
        raise MoeSwarmError(f"swarm key {key_file} not found: make one with `moeswarm keygen -o {key_file}`")
    context = SwarmContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # the pinned certificate is the identity, not a host name
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(key_file)
        context.load_verify_locations(key_file)
    except (ssl.SSLError, ValueError) as error:
        raise MoeSwarmError(f"swarm key {key_file} is not a key and certificate made by `moeswarm keygen` ({error})") from None
    context.authority = Authority.load(key_file)  # the swarm's certificate, and FILE.revoked beside the key
    context.member = _own_member(key_file, context.authority)
    return context


def _own_member(key_file: Path, authority: Authority) -> str | None:
    """This process's member certificate as a refusal names it; None for the swarm key itself."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    own = x509.load_pem_x509_certificates(key_file.read_bytes())[0]  # load_cert_chain took the first one
    try:
        member = authority.check(own.public_bytes(serialization.Encoding.DER), revocation=False)
    except CertError:
        return None  # the swarm's own certificate: not a member's
    return f"{member.name!r} (serial {member.serial:x})"


class RevocationWatch:
    """Finds connections whose member was revoked after they connected: `revoked` names each one's
    reason, checking peers again only when the revocation list has changed since the last call."""

    def __init__(self, context: ssl.SSLContext):
        self.authority = getattr(context, "authority", None)
        self._seen = None if self.authority is None else self.authority.revoked

    def changed(self) -> bool:
        """Whether the list changed since the last call (it is re-read at most once a second)."""
        if self.authority is None:
            return False
        try:
            current = self.authority.revoked
        except CertError:  # unreadable for now: new handshakes are refused; connections stay until it reads
            return False
        if current is self._seen:
            return False
        self._seen = current
        return True


def revoked_reason(connection: ssl.SSLSocket | ssl.SSLObject | None) -> str | None:
    """Why a connected peer is no longer a member (revoked, or the list unreadable); None while it is."""
    if connection is None:
        return None
    try:
        check_peer(connection)
    except PeerRefused as error:
        return error.reason
    except (OSError, ValueError):  # closing already
        return None
    return None
