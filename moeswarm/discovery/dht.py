"""Discovery on hivemind's DHT (the one Petals uses): where workers announce themselves and backbones look.

The DHT carries announcements only (discovery/record.py): who holds which experts of which
model, where to dial them, with an expiry. Requests never travel over it: the hot path stays on
moeswarm's own TCP protocol (libp2p's daemon adds milliseconds per message).

hivemind is an optional extra (`pip install 'moeswarm[swarm]'`): it is imported only when a DHT
node is opened, so `--workers` works without it.

    peers "new"                      start a new swarm: this node is its first peer
    peers /ip4/H/tcp/P/p2p/ID,...    join the swarm those peers are in

With a swarm key, the node is keyed (`authority`): hivemind runs discovery/sign.py's validator
on every record this node stores or reads, records are signed by this process's member key
(`identity`), and `fetch` checks them again, revocation list included. Without one, any DHT peer
can pose as a worker: `open` warns once, and `fetch` still bounds what one host can add.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
from collections import Counter
from collections.abc import Sequence

from moeswarm.errors import MoeSwarmError, one_line, printable
from moeswarm.discovery.record import WORKERS, Announcement, RecordError, RecordKind
from moeswarm.transport.member_cert import Authority, Identity

log = logging.getLogger("moeswarm.discovery")

INSTALL_HINT = "pip install 'moeswarm[swarm]'"
NEW_SWARM = "new"
START_TIMEOUT_S = 60.0
STORE_TIMEOUT_S = 10.0  # the longest one announcement (or its withdrawal) is waited for
MAX_RECORDS = 4096  # announcements read per model; more are ignored (and said so)
MAX_PER_MEMBER = 16  # a keyed swarm: workers one member may announce per model
MAX_PER_HOST = 16  # workers announced at one host (its ports): a flood from one machine adds no more
MAX_CAUSES_LOGGED = 8  # distinct causes of ignored announcements logged per read; then one line counts them all
UNKEYED_WARNING = ("moeswarm: warning: --swarm without --swarm-key: any peer that reaches the DHT can pose as a "
                   "worker (announce a fake one, or withdraw a real one); give every member a swarm key "
                   "(docs/discovery.md)")
_warned = False


def parse_peers(text: str) -> list[str]:
    """`--swarm`'s value: [] for "new", else the comma-separated multiaddrs; ValueError naming the bad one."""
    if text.strip() == NEW_SWARM:
        return []
    peers = [p.strip() for p in text.split(",") if p.strip()]
    if not peers:
        raise ValueError("empty peer list: give /ip4/HOST/tcp/PORT/p2p/PEER_ID[,...] (or 'new' on the first worker)")
    for peer in peers:
        if not peer.startswith("/") or "/p2p/" not in peer or not peer.isprintable():
            raise ValueError(f"bad swarm peer {peer[:200]!r}: expected a multiaddr such as "
                             "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... (printed by the first worker or `moeswarm dht`)")
    return peers


class SwarmDht:
    """One node of the DHT: a worker's (a full node) or a backbone's (client mode: it stores nothing)."""

    def __init__(self, node, authority: Authority | None = None, identity: Identity | None = None):
        self._node = node  # hivemind.dht.DHT, running in its own process
        self.authority = authority  # keyed: records are checked against the swarm's certificate
        self.identity = identity  # keyed and announcing: this process's member key signs its records
        self._problems: set[str] = set()  # malformed records already logged

    @classmethod
    def open(cls, peers: Sequence[str], host: str = "127.0.0.1", port: int = 0, client: bool = False,
             timeout_s: float = START_TIMEOUT_S, authority: Authority | None = None,
             identity: Identity | None = None) -> "SwarmDht":
        """Start a node; join `peers` (none: start a new swarm). MoeSwarmError when that fails.

        authority: the swarm's certificate (transport/member_cert.py), for a keyed swarm; None: unkeyed (warned once).
        identity: this process's member key, to sign the records it stores (a worker's)."""
        global _warned
        try:
            from moeswarm.discovery.dht_process import WatchedDHT
            validators = []
            if authority is not None:
                from moeswarm.discovery.sign import MemberValidator
                validators = [MemberValidator(authority)]
        except ImportError as error:
            missing = "is not installed" if (error.name or "").split(".")[0] == "hivemind" else f"cannot load ({error})"
            raise MoeSwarmError(f"--swarm needs hivemind, which {printable(missing)}: {INSTALL_HINT}") from None
        if client and not peers:
            raise MoeSwarmError("a backbone joins an existing swarm: give --swarm the multiaddr of a worker or of "
                                "`moeswarm dht`, not 'new'")
        options = {} if client else {"host_maddrs": [listen_maddr(host, port)]}
        try:
            node = WatchedDHT(initial_peers=list(peers), start=True, client_mode=client, await_ready=False,
                              record_validators=validators, **options)
            node.wait_until_ready(timeout_s)
        except Exception as error:  # hivemind raises its own types (P2PDaemonError, TimeoutError, ...)
            raise MoeSwarmError(f"cannot {'join the swarm at ' + ', '.join(peers) if peers else 'start a swarm'}: "
                                f"{printable(one_line(error))}") from None
        if authority is None and not _warned:
            _warned = True
            print(UNKEYED_WARNING, file=sys.stderr, flush=True)
        return cls(node, authority, identity)

    def addresses(self) -> list[str]:
        """The multiaddrs other peers can join this node by (its peer id included)."""
        return [str(m) for m in self._node.get_visible_maddrs()]

    def store(self, record, ttl_s: float, timeout_s: float = STORE_TIMEOUT_S, kind: RecordKind = WORKERS) -> bool:
        """Announce `record` (an Announcement, or a record of `kind`: its `address`, `fingerprint` and
        `to_value()`) until `ttl_s` from now (a later store replaces it); False if no peer took it.
        MoeSwarmError after `timeout_s`: the DHT process may be gone (a Ctrl-C reaches the whole process
        group), and a worker stopping must not wait on it forever."""
        from hivemind.utils import get_dht_time

        key, subkey, value = kind.key(record.fingerprint), record.address, record.to_value()
        expiration_time = get_dht_time() + ttl_s
        if self.authority is not None:
            if self.identity is None:
                raise MoeSwarmError("a keyed DHT node stores only signed records: open it with this member's identity")
            from moeswarm.discovery.sign import member_subkey, sign_record

            subkey = member_subkey(self.identity.member_id, record.address)
            value = sign_record(self.identity, key, subkey, value, expiration_time)
        pending = self._node.store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)
        try:
            return bool(pending.result(timeout=timeout_s))
        except TimeoutError:
            raise MoeSwarmError(f"the DHT did not answer within {timeout_s:g} s") from None

    def fetch(self, fingerprint: str, kind: RecordKind = WORKERS) -> dict[str, Announcement]:
        """The online workers (or records of `kind`) announced for model `fingerprint`, by address (the
        first claim of each, see `claims`)."""
        return {address: claims[0] for address, claims in self.claims(fingerprint, kind).items()}

    def claims(self, fingerprint: str, kind: RecordKind = WORKERS) -> dict[str, list]:
        """The online announcements for model `fingerprint`, by address, in subkey order. Malformed
        entries are skipped (each cause logged once, escaped); withdrawn ones (online false) are left
        out. Keyed: an entry counts only when signed by a member of the swarm under its own subkey,
        not revoked, at most MAX_PER_MEMBER per member; several members may claim one address (only
        the worker's HELLO tells which is right: discovery/follow.py tries them in turn).
        Unkeyed: one claim per address, at most MAX_PER_HOST per host.
        kind: workers' announcements (Announcement), or stages' records (discovery/stage_record.py)."""
        found = self._node.get(kind.key(fingerprint), latest=True)
        entries = found.value if found is not None else {}
        if not isinstance(entries, dict):  # someone stored a plain value under the key
            self._problem(f"the key of model {fingerprint} holds a {type(entries).__name__}, not announcements")
            return {}
        if len(entries) > MAX_RECORDS:
            self._problem(f"{len(entries)} announcements for model {fingerprint}: only the first {MAX_RECORDS} are read")
        records: dict[str, list] = {}
        per_member: Counter[str] = Counter()
        per_host: Counter[str] = Counter()
        ignored: list[str] = []  # why, per entry left out (a flood must not become as many log lines)
        for subkey, entry in sorted(entries.items(), key=lambda item: str(item[0]))[:MAX_RECORDS]:
            try:
                signer, record = self._open(fingerprint, subkey, entry, kind)
            except RecordError as error:
                ignored.append(f"ignoring an announcement under {str(subkey)[:100]!r}: {error}")
                continue
            host = _host(record.address)
            if signer and per_member[signer] >= MAX_PER_MEMBER:
                ignored.append(f"ignoring announcements beyond the cap per member {signer}: {MAX_PER_MEMBER} workers")
            elif not signer and per_host[host] >= MAX_PER_HOST:  # unkeyed: anyone's; keyed: members are capped
                ignored.append(f"ignoring announcements beyond the cap per host {host}: {MAX_PER_HOST} workers")
            else:
                per_member[signer] += 1
                per_host[host] += 1
                if record.online:
                    records.setdefault(record.address, []).append(record)
        causes = sorted(dict.fromkeys(ignored), key=lambda cause: "cap" not in cause)  # caps first: they say the most
        for cause in causes[:MAX_CAUSES_LOGGED]:
            self._problem(f"{cause} (model {fingerprint})")
        if len(causes) > MAX_CAUSES_LOGGED:
            self._problem(f"{len(ignored)} announcements of model {fingerprint} ignored in all (the first "
                          f"{MAX_CAUSES_LOGGED} causes logged)")
        return records

    def _open(self, fingerprint: str, subkey: object, entry: object, kind: RecordKind) -> tuple[str, object]:
        """(the signer: a member id, or "" unkeyed; the announcement) of one entry; RecordError if it does not count."""
        value = getattr(entry, "value", None)
        if self.authority is None:
            if isinstance(value, dict) and {"body", "cert", "sig"} <= value.keys():
                raise RecordError("a signed record of a keyed swarm: give --swarm-key to read it")
            return "", kind.parse(subkey, value, fingerprint)
        from moeswarm.discovery.sign import key_id, open_record

        signer, body = open_record(self.authority, key_id(kind.key(fingerprint)), subkey, value,
                                   getattr(entry, "expiration_time", 0.0))
        return signer.member_id, kind.parse(body.get("address"), body, fingerprint)

    def _problem(self, message: str) -> None:
        message = printable(message, 400)
        if message not in self._problems:
            if len(self._problems) >= MAX_RECORDS:  # a peer varying its garbage cannot grow this without bound
                self._problems.clear()
            self._problems.add(message)
            log.warning(message)

    def close(self) -> None:
        """Stop the node (and its p2pd)."""
        self._node.shutdown()


def _host(address: str) -> str:
    """The host a worker spec reaches first (its direct host, else its relay's)."""
    return address.split("+", 1)[0].removeprefix("relay://").split("/", 1)[0].rpartition(":")[0]


def listen_maddr(host: str, port: int) -> str:
    """The multiaddr a DHT node listens on for `--host` (a name is resolved: p2pd listens on addresses)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, ValueError) as error:
            raise MoeSwarmError(f"cannot resolve --host {printable(host)!r} for the DHT node: {error}") from None
    return f"/ip{address.version}/{address}/tcp/{port}"
