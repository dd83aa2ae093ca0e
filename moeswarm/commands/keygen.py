"""`moeswarm keygen`: make a swarm key, certify a member with it, or revoke a member (transport/member_cert.py).

    moeswarm keygen -o swarm.key                                          the swarm key (keep it with the admin)
    moeswarm keygen --member gpu-1 --swarm-key swarm.key -o gpu-1.pem     a member file for one worker or backbone
    moeswarm keygen --revoke gpu-1.pem --swarm-key swarm.key              add it to swarm.key.revoked
"""

from __future__ import annotations

import argparse

from moeswarm.commands._types import seconds
from moeswarm.errors import MoeSwarmError
from moeswarm.wire.relay import RelayError, check_name
from moeswarm.transport import member_cert
from moeswarm.transport.tls import write_swarm_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--out", default=None,
                        help="file to write (it must not exist; written readable by you only)")
    parser.add_argument("--member", default=None, metavar="NAME",
                        help="certify a new member key NAME (1 to 64 of A-Z a-z 0-9 . _ -; a relay registers the "
                             "member under this name) with --swarm-key, written to -o")
    parser.add_argument("--revoke", default=None, metavar="MEMBER_FILE",
                        help="revoke this member file's certificate: its serial is added to SWARM_KEY.revoked, which "
                             "workers, backbones, DHT nodes and relays read beside their own --swarm-key file")
    parser.add_argument("--swarm-key", default=None, metavar="FILE", help="the swarm key, for --member and --revoke")
    parser.add_argument("--days", type=seconds, default=None,
                        help="days a member certificate is valid (default 90)")


def run(args: argparse.Namespace) -> int:
    if args.member is not None or args.revoke is not None:
        if args.member is not None and args.revoke is not None:
            raise MoeSwarmError("give --member or --revoke, not both")
        if not args.swarm_key:
            raise MoeSwarmError(f"--{'member' if args.member is not None else 'revoke'} needs --swarm-key: the swarm key "
                                "that certifies the swarm's members")
    if args.revoke is not None:
        path, name, serial = member_cert.revoke(args.swarm_key, args.revoke)
        print(f"revoked member {name} (serial {serial:x}) in {path}: copy it beside the --swarm-key file of every "
              "worker, backbone, DHT node and relay of this swarm (as FILE.revoked)")
        return 0
    if not args.out:
        raise MoeSwarmError("give -o FILE to write")
    if args.member is not None:
        try:
            check_name(args.member)
        except RelayError as error:
            raise MoeSwarmError(f"--member: {error}") from None
        path = member_cert.write_member(args.swarm_key, args.member, args.out, args.days or member_cert.MEMBER_DAYS)
        print(f"wrote member file {path} for {args.member}: pass --swarm-key {path} to that member's worker or "
              "backbone (it signs its announcements and relay registrations; keep it secret)")
        return 0
    if args.days is not None:
        raise MoeSwarmError("--days applies to --member")
    path = write_swarm_key(args.out)
    print(f"wrote swarm key {path}: pass --swarm-key {path} (or MOESWARM_SWARM_KEY={path}) to every worker, "
          "generate and serve of this swarm, and keep it secret (or give each member its own file: "
          f"`moeswarm keygen --member NAME --swarm-key {path} -o NAME.pem`)")
    return 0
