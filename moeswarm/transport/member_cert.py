"""Member certificates: each member of a keyed swarm has its own key pair, certified by the swarm key.

The swarm key (`moeswarm keygen -o swarm.key`, transport/tls.py) is a small certificate authority:
its certificate is what every member trusts. `moeswarm keygen --member NAME --swarm-key swarm.key
-o NAME.pem` writes a member file: the member's own Ed25519 private key, its certificate (subject
NAME, a serial, 90 days by default) signed by the swarm key, and the swarm's certificate. A member
file works as `--swarm-key` wherever the swarm key does (TLS verifies the member certificate
against the swarm's), without giving the member the power to certify anyone.

A member signs what it publishes: its DHT announcements (discovery/sign.py) and its relay
registrations (wire/relay.py). Readers check the certificate against the swarm's, the
signature against the certificate, and the certificate against the revocation list. Every TLS
handshake checks the peer's certificate against the list too (transport/tls.py).

Revocation: `moeswarm keygen --revoke NAME.pem --swarm-key swarm.key` appends the certificate's
serial to `swarm.key.revoked`. A process given `--swarm-key FILE` reads `FILE.revoked` beside it
(when present) and re-reads it when it changes: copy the list beside the key of every worker,
backbone, DHT node and relay. A revoked member's records, relay registrations and TLS handshakes
are refused from then on; a certificate that nobody revoked still ends at its expiry.

A process given the swarm key itself (it holds the authority's private key) certifies itself at
start (`Identity.load` of a swarm key): it needs no member file, and cannot be revoked.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from moeswarm.errors import MoeSwarmError, printable

SWARM_SUBJECT = "moeswarm swarm"  # transport/tls.py's certificate subject
MEMBER_DAYS = 90
MAX_CERTIFICATE = 2048  # bytes of DER read from the network (a member certificate is ~400)
MEMBER_ID_HEX = 32
REVOKED_SUFFIX = ".revoked"


class CertError(ValueError):
    """A member certificate that is not valid here (its text says why, in one line)."""


@dataclass(frozen=True)
class MemberCert:
    """What a checked member certificate says."""

    name: str
    member_id: str  # hex of the first 16 bytes of SHA-256 of the raw Ed25519 public key
    serial: int
    not_after: float  # Unix time
    public_key: object  # Ed25519PublicKey

    def verify(self, signature: bytes, data: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self.public_key.verify(signature, data)
        except InvalidSignature:
            return False
        return True


def member_id(public_key) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:MEMBER_ID_HEX]


class Authority:
    """The swarm's certificate and its revocation list: checks member certificates.

    Built from any file given to `--swarm-key` (the swarm key, or a member file: both hold the
    swarm's certificate). Picklable state only, so a DHT process can carry it."""

    def __init__(self, certificate_der: bytes, revoked_path: str | None = None):
        self.certificate_der = certificate_der
        self.revoked_path = revoked_path
        self._revoked: frozenset[int] = frozenset()
        self._revoked_stamp: tuple | None = None
        self._checked_at = 0.0
        self._certificate = None  # parsed on first use

    @classmethod
    def load(cls, key_file: str | os.PathLike) -> "Authority":
        certificate = _swarm_certificate(_certificates(key_file), key_file)
        from cryptography.hazmat.primitives import serialization

        return cls(certificate.public_bytes(serialization.Encoding.DER), str(key_file) + REVOKED_SUFFIX)

    def revoked(self) -> frozenset[int]:
        """Serials of revoked member certificates (the list is re-read when it changes, at most once a
        second). CertError while the list cannot be read: every member is refused until it is fixed,
        rather than a revoked one let back in."""
        now = time.monotonic()
        if self.revoked_path is None or now - self._checked_at < 1.0:
            return self._revoked
        self._checked_at = now
        try:
            stat = os.stat(self.revoked_path)
        except FileNotFoundError:
            self._revoked, self._revoked_stamp = frozenset(), None
            return self._revoked
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._revoked_stamp:
            try:
                self._revoked = read_revoked(self.revoked_path)
            except (MoeSwarmError, OSError) as error:
                self._checked_at = 0.0  # read it again at the next check
                raise CertError(f"cannot use the revocation list: {error}") from None
            self._revoked_stamp = stamp
        return self._revoked

    def check(self, der: bytes, now: float | None = None, revocation: bool = True) -> MemberCert:
        """The member `der` certifies; CertError naming the first thing wrong (not signed by this
        swarm's key, not a member certificate, expired, revoked: unless `revocation` is False)."""
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ed25519

        if not isinstance(der, bytes) or not 0 < len(der) <= MAX_CERTIFICATE:
            raise CertError(f"a certificate is 1 to {MAX_CERTIFICATE} bytes of DER")
        try:
            certificate = x509.load_der_x509_certificate(der)
        except ValueError:
            raise CertError("not a DER certificate") from None
        swarm = self._swarm()
        try:
            certificate.verify_directly_issued_by(swarm)
        except (ValueError, TypeError):
            raise CertError("certificate not issued by this swarm's key") from None
        except Exception:  # cryptography's InvalidSignature
            raise CertError("certificate not signed by this swarm's key") from None
        try:
            key = certificate.public_key()
        except Exception:  # a key type cryptography does not support
            raise CertError("not a member certificate (an unsupported key)") from None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise CertError("not a member certificate (its key is not Ed25519)")
        name = _common_name(certificate)
        now = time.time() if now is None else now
        if not certificate.not_valid_before_utc.timestamp() <= now <= certificate.not_valid_after_utc.timestamp():
            raise CertError(f"certificate of member {printable(name)!r} is not valid now "
                            f"(valid {certificate.not_valid_before_utc:%Y-%m-%d} to {certificate.not_valid_after_utc:%Y-%m-%d})")
        if revocation and certificate.serial_number in self.revoked():
            raise CertError(f"member {printable(name)!r} (serial {certificate.serial_number:x}) is revoked")
        return MemberCert(name, member_id(key), certificate.serial_number, certificate.not_valid_after_utc.timestamp(), key)

    def _swarm(self):
        if self._certificate is None:
            from cryptography import x509

            self._certificate = x509.load_der_x509_certificate(self.certificate_der)
        return self._certificate

    def __getstate__(self):
        return {"certificate_der": self.certificate_der, "revoked_path": self.revoked_path}

    def __setstate__(self, state):
        self.__init__(state["certificate_der"], state["revoked_path"])


class Identity:
    """This process's member key and certificate: what it signs its records and registrations with."""

    def __init__(self, private_key, certificate_der: bytes, name: str):
        self._key = private_key
        self.certificate_der = certificate_der
        self.name = name
        self.member_id = member_id(private_key.public_key())

    @classmethod
    def load(cls, key_file: str | os.PathLike, name: str | None = None) -> "Identity":
        """A member file's identity; for the swarm key itself, a certificate it issues itself now
        (named `name`: the swarm key's holder may take any name)."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec, ed25519

        certificates = _certificates(key_file)
        key = _private_key(key_file)
        if isinstance(key, ec.EllipticCurvePrivateKey):  # the swarm key: certify a key of our own
            own = ed25519.Ed25519PrivateKey.generate()
            name = name or f"swarm-key-{os.getpid()}"
            certificate = issue(key, _swarm_certificate(certificates, key_file), own.public_key(), name, MEMBER_DAYS)
            return cls(own, certificate.public_bytes(serialization.Encoding.DER), name)
        if not isinstance(key, ed25519.Ed25519PrivateKey) or not certificates:
            raise MoeSwarmError(f"{key_file} is neither a swarm key nor a member file made by `moeswarm keygen`")
        leaf = certificates[0]
        if member_id(leaf.public_key()) != member_id(key.public_key()):
            raise MoeSwarmError(f"{key_file}: the member certificate is not for the key in the file")
        return cls(key, leaf.public_bytes(serialization.Encoding.DER), _common_name(leaf))

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)


def issue(authority_key, authority_certificate, public_key, name: str, days: float):
    """A member certificate for `public_key`, named `name`, signed by the swarm key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(authority_certificate.subject).public_key(public_key)
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(authority_key, hashes.SHA256())
    )


def write_member(swarm_key: str | os.PathLike, name: str, out: str | os.PathLike, days: float = MEMBER_DAYS) -> Path:
    """A new member file `out` (key, certificate, the swarm's certificate), readable by its owner only."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    out = Path(out)
    if out.exists():
        raise MoeSwarmError(f"{out} already exists: choose another -o, or remove it first")
    authority_key = _private_key(swarm_key)
    if not isinstance(authority_key, ec.EllipticCurvePrivateKey):
        raise MoeSwarmError(f"{swarm_key} is not a swarm key (a member file cannot certify members)")
    swarm = _swarm_certificate(_certificates(swarm_key), swarm_key)
    key = ed25519.Ed25519PrivateKey.generate()
    certificate = issue(authority_key, swarm, key.public_key(), name, days)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pem += certificate.public_bytes(serialization.Encoding.PEM) + swarm.public_bytes(serialization.Encoding.PEM)
    descriptor = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(pem)
    return out


def revoke(swarm_key: str | os.PathLike, member_file: str | os.PathLike) -> tuple[Path, str, int]:
    """Append the member certificate of `member_file` to `swarm_key`'s revocation list: (list, name, serial)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    if not isinstance(_private_key(swarm_key), ec.EllipticCurvePrivateKey):
        raise MoeSwarmError(f"{swarm_key} is not a swarm key: only the swarm key's holder revokes members")
    swarm = _swarm_certificate(_certificates(swarm_key), swarm_key)
    members = [c for c in _certificates(member_file) if c.subject != swarm.subject]
    if not members:
        raise MoeSwarmError(f"{member_file} holds no member certificate")
    member = members[0]
    if member.issuer != swarm.subject:
        raise MoeSwarmError(f"{member_file} was not certified by {swarm_key}")
    try:
        member.verify_directly_issued_by(swarm)
    except Exception:
        raise MoeSwarmError(f"{member_file} was not certified by {swarm_key}") from None
    path = Path(str(swarm_key) + REVOKED_SUFFIX)
    name = _common_name(member)
    with open(path, "a", encoding="ascii") as file:
        file.write(f"{member.serial_number:x} {name.encode('ascii', 'replace').decode()}\n")
    return path, name, member.serial_number


def read_revoked(path: str | os.PathLike) -> frozenset[int]:
    """Serials in a revocation list (`SERIAL_HEX NAME` a line; '#' comments). A bad line is an error
    naming it: a list read wrong must not silently let a revoked member back in."""
    serials = set()
    for number, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        field = line.split("#", 1)[0].split(maxsplit=1)
        if not field:
            continue
        try:
            serials.add(int(field[0], 16))
        except ValueError:
            raise MoeSwarmError(f"revocation list {path} line {number}: {printable(field[0][:40])!r} is not a "
                                "hexadecimal serial") from None
    return frozenset(serials)


def _certificates(key_file):
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(Path(key_file).read_bytes())
    except FileNotFoundError:
        raise MoeSwarmError(f"swarm key {key_file} not found: make one with `moeswarm keygen -o {key_file}`") from None
    except ValueError:
        raise MoeSwarmError(f"{key_file} holds no certificate: not a swarm key or member file from `moeswarm keygen`") from None


def _private_key(key_file):
    from cryptography.hazmat.primitives import serialization

    try:
        return serialization.load_pem_private_key(Path(key_file).read_bytes(), None)
    except FileNotFoundError:
        raise MoeSwarmError(f"swarm key {key_file} not found: make one with `moeswarm keygen -o {key_file}`") from None
    except (ValueError, TypeError):
        raise MoeSwarmError(f"{key_file} holds no unencrypted private key: not a swarm key or member file "
                            "from `moeswarm keygen`") from None


def _swarm_certificate(certificates, key_file):
    for certificate in certificates:
        if certificate.subject == certificate.issuer and _common_name(certificate) == SWARM_SUBJECT:
            return certificate
    raise MoeSwarmError(f"{key_file} holds no swarm certificate: not a swarm key or member file from `moeswarm keygen`")


def _common_name(certificate) -> str:
    from cryptography.x509.oid import NameOID

    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""
