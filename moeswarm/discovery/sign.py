"""Signed announcements: with a swarm key, every DHT record is signed by its member and checked by every node.

A keyed worker stores its announcement (discovery/record.py), a keyed stage its stage record
(discovery/stage_record.py, under the model's stage key), and a keyed member's seed its seed record
(discovery/seed_record.py, under the model's seed key), under the subkey `MEMBER_ID@ADDRESS` as

    {"body": msgpack of the announcement, "cert": the member's certificate (DER), "sig": Ed25519 signature}

where the signature covers ("moeswarm-record/1", the DHT key's id, the subkey's bytes, body, the
record's expiration time). `MemberValidator` is given to hivemind's DHT as a record validator, so
every node of a keyed swarm checks each record it is asked to store, and each one another node
returns, before it is kept or used: the certificate was issued by the swarm key, the subkey's
member id is that certificate's key, the signature holds, the body names the subkey's address
and the model of the DHT key, and the record expires before the certificate does. So:

- a record signed by no member, or by a key the swarm did not certify, is refused: it adds no worker;
- only the member a subkey names can store under it (its expiry is signed too: nobody replays an
  old record with a later expiry), so a forged `online: false` removes no worker;
- a keyed node stores nothing else: everything on a keyed swarm's DHT is a member's record.

The revocation list (transport/member_cert.py) is applied by readers, not by the validator: hivemind
drops a node's whole answer when one of its entries fails validation, and nodes whose lists
differ for a while must not make each other's honest records vanish.

This module imports hivemind: only `--swarm` loads it.
"""

from __future__ import annotations

import logging

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from moeswarm.errors import printable
from moeswarm.discovery.record import RecordError, announcement_key
from moeswarm.discovery.seed_record import seed_key
from moeswarm.discovery.stage_record import stage_key
from moeswarm.transport.member_cert import MEMBER_ID_HEX, Authority, CertError, Identity, MemberCert

log = logging.getLogger("moeswarm.discovery")

DOMAIN = "moeswarm-record/1"
MAX_BODY = 1 << 16  # far above any announcement (a few hundred bytes)
SIGNATURE_BYTES = 64
MAX_SAID = 256


def member_subkey(member_id: str, address: str) -> str:
    return f"{member_id}@{address}"


def split_subkey(subkey: object) -> tuple[str, str]:
    """(member id, address) of a signed record's subkey; RecordError when it is not one."""
    if not isinstance(subkey, str) or len(subkey) > 700:
        raise RecordError("subkey is not MEMBER_ID@ADDRESS text")
    member, at, address = subkey.partition("@")
    if not at or len(member) != MEMBER_ID_HEX or any(c not in "0123456789abcdef" for c in member):
        raise RecordError(f"subkey {printable(subkey[:80])!r} is not MEMBER_ID@ADDRESS")
    return member, address


def key_id(key: str) -> bytes:
    """The DHT's id of `key` (what validators see as a record's key)."""
    return DHTID.generate(source=key).to_bytes()


def signed_bytes(key_id_bytes: bytes, subkey: str, body: bytes, expiration_time: float) -> bytes:
    return MSGPackSerializer.dumps([DOMAIN, key_id_bytes, MSGPackSerializer.dumps(subkey), body, float(expiration_time)])


def sign_record(identity: Identity, key: str, subkey: str, value: dict, expiration_time: float) -> dict:
    """The signed DHT value of announcement `value` (Announcement.to_value()) under `key`/`subkey`."""
    body = MSGPackSerializer.dumps(value)
    signature = identity.sign(signed_bytes(key_id(key), subkey, body, expiration_time))
    return {"body": body, "cert": identity.certificate_der, "sig": signature}


def open_record(authority: Authority, key_id_bytes: bytes, subkey: object, value: object, expiration_time: float,
                revocation: bool = True) -> tuple[MemberCert, dict]:
    """(the signer, the announcement's value) of one signed DHT entry; RecordError naming what is wrong."""
    member, address = split_subkey(subkey)
    if not (isinstance(value, dict) and isinstance(value.get("body"), bytes) and isinstance(value.get("cert"), bytes)
            and isinstance(value.get("sig"), bytes)):
        raise RecordError("not a signed record ({body, cert, sig}): unsigned records are refused on a keyed swarm")
    body = value["body"]
    if len(body) > MAX_BODY or len(value["sig"]) != SIGNATURE_BYTES:
        raise RecordError(f"body over {MAX_BODY} bytes or a signature that is not {SIGNATURE_BYTES} bytes")
    try:
        signer = authority.check(value["cert"], revocation=revocation)
    except CertError as error:
        raise RecordError(str(error)) from None
    if signer.member_id != member:
        raise RecordError(f"stored under member {member} by member {signer.member_id} "
                          f"({printable(signer.name)!r}): only a subkey's member may write it")
    if not signer.verify(value["sig"], signed_bytes(key_id_bytes, subkey, body, expiration_time)):
        raise RecordError(f"bad signature (member {printable(signer.name)!r})")
    if expiration_time > signer.not_after:
        raise RecordError(f"expires after the certificate of member {printable(signer.name)!r}")
    try:
        announcement = MSGPackSerializer.loads(body)
    except Exception:
        raise RecordError("body is not msgpack") from None
    if not isinstance(announcement, dict) or announcement.get("address") != address:
        raise RecordError("body names another address than its subkey")
    fingerprint = announcement.get("fingerprint")
    if not isinstance(fingerprint, str) or len(fingerprint) > 128 or \
            key_id_bytes not in (key_id(announcement_key(fingerprint)), key_id(stage_key(fingerprint)),
                                 key_id(seed_key(fingerprint))):
        raise RecordError("body names another model than its DHT key")
    return signer, announcement


class MemberValidator(RecordValidatorBase):
    """hivemind's record validator of a keyed swarm: a record is kept or used only when a member of
    the swarm signed it under its own subkey (see the module's docstring). Refusals are logged once
    per cause (escaped), never raised."""

    def __init__(self, authority: Authority):
        self.authority = authority
        self._said: set[str] = set()

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
            open_record(self.authority, record.key, subkey, value, record.expiration_time, revocation=False)
        except RecordError as error:
            self._say(str(error))
            return False
        except Exception as error:  # msgpack's errors on bytes that are not msgpack
            self._say(f"not msgpack ({type(error).__name__})")
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, MemberValidator)  # one is enough

    def _say(self, cause: str) -> None:
        if cause not in self._said and len(self._said) < MAX_SAID:
            self._said.add(cause)
            log.warning("DHT: refused a record: %s", printable(cause, 300))
