"""`moeswarm wan`: run the WAN emulator proxy, or measure its accuracy with --selftest.

    moeswarm wan --listen 127.0.0.1:9001 --upstream 127.0.0.1:9000 --rtt 80ms \\
        [--jitter 5ms] [--bandwidth 100mbit] [--control 127.0.0.1:9002] [--seed N]
    moeswarm wan --selftest [--rtt 80ms] [--bandwidth 100mbit] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from moeswarm.errors import MoeSwarmError
from moeswarm_bench.wan.control import ControlServer
from moeswarm_bench.wan.link import LinkProfile, parse_bandwidth, parse_duration
from moeswarm_bench.wan.measure import run_selftest
from moeswarm_bench.wan.proxy import WanProxy
from moeswarm_bench.wan.running import run_proxy

SELFTEST_RTT = "80ms"
SELFTEST_BANDWIDTH = "100mbit"


def _flag_type(parse):
    """Adapt a ValueError-raising parser so argparse names the flag: `argument --rtt: bad ...`."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__
    return convert


def parse_address(text: str) -> tuple[str, int]:
    """`"127.0.0.1:9000"`, `":9000"` (loopback), `"[::1]:9000"` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9000")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def _duration(text: str) -> float:
    return parse_duration(text)


def _bandwidth(text: str) -> float | None:
    return None if text.lower() in ("off", "none", "unlimited") else parse_bandwidth(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    address, duration = _flag_type(parse_address), _flag_type(_duration)
    parser.add_argument("--listen", type=address, metavar="HOST:PORT", help="where clients connect (required unless --selftest)")
    parser.add_argument("--upstream", type=address, metavar="HOST:PORT", help="where the proxy connects (required unless --selftest)")
    parser.add_argument("--rtt", type=duration, help=f"round-trip delay, e.g. 80ms (default 0; selftest {SELFTEST_RTT})")
    parser.add_argument("--jitter", type=duration, default=0.0, help="+- one-way delay spread, e.g. 5ms")
    parser.add_argument(
        "--bandwidth",
        type=_flag_type(_bandwidth),
        help=f"per-direction rate, e.g. 100mbit, 1gbit, 12.5MB/s, off (default off; selftest {SELFTEST_BANDWIDTH})",
    )
    parser.add_argument("--control", type=address, metavar="HOST:PORT", help="line-based control port (default: none)")
    parser.add_argument(
        "--spin",
        type=duration,
        default=None,
        help="busy-wait (yielding) this long before each delivery for timer precision (default 1.2ms; 0: off)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the jitter (default: from the clock)")
    parser.add_argument("--selftest", action="store_true", help="measure configured vs actual RTT and rate")
    parser.add_argument("--json", action="store_true", help="selftest: print the measurement as JSON")
    parser.add_argument("--rounds", type=int, default=50, help="selftest: ping-pong round trips")
    parser.add_argument("--bytes", type=int, default=None, help="selftest: bytes for the rate measurement (default: about one second at --bandwidth, 256 KiB to 64 MiB)")


def run(args: argparse.Namespace) -> int:
    if args.selftest:
        rtt = _duration(SELFTEST_RTT) if args.rtt is None else args.rtt
        bandwidth = _bandwidth(SELFTEST_BANDWIDTH) if args.bandwidth is None else args.bandwidth
        return _selftest(LinkProfile(rtt, args.jitter, bandwidth), args)
    if args.listen is None or args.upstream is None:
        raise MoeSwarmError("--listen and --upstream are both required (or use --selftest)")
    profile = LinkProfile(args.rtt or 0.0, args.jitter, args.bandwidth)
    proxy = WanProxy(args.listen, args.upstream, profile, seed=args.seed, **_spin(args))
    run_proxy(proxy, args.control, on_listening=lambda proxy, control: _say_listening(proxy, control, args.upstream))
    return 0


def _say_listening(proxy: WanProxy, control: ControlServer | None, upstream: tuple[str, int]) -> None:
    line = f"wan: listening on {_fmt(proxy.address)} -> {_fmt(upstream)} {proxy.profile.describe()}"
    if control:
        line += f" control={_fmt(control.address)}"
    print(f"{line} seed={proxy.seed}", flush=True)


def _spin(args: argparse.Namespace) -> dict[str, float]:
    return {} if args.spin is None else {"spin_s": args.spin}


def _fmt(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _selftest(profile: LinkProfile, args: argparse.Namespace) -> int:
    result = asyncio.run(run_selftest(profile, rounds=args.rounds, n_bytes=args.bytes, seed=args.seed or 0, **_spin(args)))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rtt, rate, timer = result["rtt"], result["throughput"], result["timer"]
    ms = lambda seconds: f"{seconds * 1e3:.3f} ms"  # noqa: E731
    mbit = lambda bps: "unlimited" if bps is None else f"{bps / 1e6:.2f} mbit/s"  # noqa: E731
    print(f"wan selftest: {profile.describe()}")
    print(
        f"  rtt        configured {ms(rtt['configured_s'])}  measured p50 {ms(rtt['p50_s'])}"
        f"  p90 {ms(rtt['p90_s'])}  (n={rtt['n']}; loopback without proxy p50 {ms(rtt['direct_p50_s'])})"
    )
    print(
        f"  bandwidth  configured {mbit(rate['configured_bps'])}  measured {mbit(rate['link_bps'])} at the"
        f" receiver, goodput {mbit(rate['goodput_bps'])} ({rate['bytes']} bytes in {rate['elapsed_s']:.3f} s)"
    )
    print(
        f"  timer      asyncio.sleep late p50 {ms(timer['asyncio_sleep_late']['p50_s'])}"
        f" max {ms(timer['asyncio_sleep_late']['max_s'])}; with a {ms(timer['spin_s'])} spin"
        f" p50 {ms(timer['spin_late']['p50_s'])} max {ms(timer['spin_late']['max_s'])}"
    )
    sys.stdout.flush()
    return 0
