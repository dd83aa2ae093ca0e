"""Member certificates: `moeswarm keygen --member/--revoke`, and what a reader says of a bad certificate."""

from __future__ import annotations

import datetime

import pytest

from moeswarm.cli import main
from moeswarm.errors import MoeSwarmError
from moeswarm.transport.member_cert import Authority, CertError, Identity, issue, read_revoked
from moeswarm.transport.tls import write_swarm_key


@pytest.fixture
def swarm(tmp_path):
    return write_swarm_key(tmp_path / "swarm.key")


def test_keygen_certifies_and_revokes_members(swarm, tmp_path, capsys):
    member = tmp_path / "gpu-1.pem"
    assert main(["keygen", "--member", "gpu-1", "--swarm-key", str(swarm), "-o", str(member)]) == 0
    assert member.stat().st_mode & 0o777 == 0o600
    identity, authority = Identity.load(member), Authority.load(swarm)
    checked = authority.check(identity.certificate_der)
    assert (checked.name, checked.member_id) == ("gpu-1", identity.member_id)
    assert Authority.load(member).check(identity.certificate_der).name == "gpu-1"  # a member file carries the swarm's cert
    capsys.readouterr()

    for args, error in [
        (["--member", "gpu-2", "--swarm-key", str(member), "-o", str(tmp_path / "x.pem")],
         f"{member} is not a swarm key (a member file cannot certify members)"),
        (["--member", "no spaces", "--swarm-key", str(swarm), "-o", str(tmp_path / "y.pem")],
         "--member: bad relay name 'no spaces': expected 1 to 64 characters of A-Z a-z 0-9 . _ -"),
        (["--member", "gpu-2", "-o", str(tmp_path / "z.pem")],
         "--member needs --swarm-key: the swarm key that certifies the swarm's members"),
        (["--revoke", str(member), "--swarm-key", str(write_swarm_key(tmp_path / "other.key"))],
         f"{member} was not certified by {tmp_path / 'other.key'}"),
    ]:
        assert main(["keygen", *args]) == 2
        assert capsys.readouterr().err == f"moeswarm keygen: error: {error}\n"

    assert main(["keygen", "--revoke", str(member), "--swarm-key", str(swarm)]) == 0
    assert read_revoked(str(swarm) + ".revoked") == {checked.serial}
    with pytest.raises(CertError, match=r"^member 'gpu-1' \(serial [0-9a-f]+\) is revoked$"):
        Authority.load(swarm).check(identity.certificate_der)


def test_bad_certificates_are_named_in_one_line(swarm, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    authority = Authority.load(swarm)
    key = serialization.load_pem_private_key(swarm.read_bytes(), None)
    from cryptography import x509

    certificate = x509.load_pem_x509_certificates(swarm.read_bytes())[0]
    expired = issue(key, certificate, ed25519.Ed25519PrivateKey.generate().public_key(), "old", 1)
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=2)
    with pytest.raises(CertError, match=r"^certificate of member 'old' is not valid now \(valid "):
        authority.check(expired.public_bytes(serialization.Encoding.DER), now=later.timestamp())
    der = bytearray(Identity.load(swarm, name="x").certificate_der)
    der[-5] ^= 1  # inside the signature
    with pytest.raises(CertError, match="^certificate not signed by this swarm's key$"):
        authority.check(bytes(der))
    with pytest.raises(CertError, match="^not a DER certificate$"):
        authority.check(b"\x30\x03abc")
    with pytest.raises(CertError, match="^not a member certificate"):
        authority.check(certificate.public_bytes(serialization.Encoding.DER))  # the swarm's own (an EC key)
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(MoeSwarmError, match="holds no certificate: not a swarm key or member file"):
        Authority.load(tmp_path / "junk.pem")
    (tmp_path / "list").write_text("# revoked\nab12 gpu-1\nnot-hex x\n")
    with pytest.raises(MoeSwarmError, match="line 3: 'not-hex' is not a hexadecimal serial"):
        read_revoked(tmp_path / "list")
    (tmp_path / "swarm.key.revoked").write_text("not-hex x\n")  # a broken list refuses every member, in one line
    with pytest.raises(CertError, match="^cannot use the revocation list: revocation list .* line 1: 'not-hex' is not"):
        Authority.load(swarm).check(Identity.load(swarm, name="y").certificate_der)

